"""``graph_exec.benchmarks.function_sizes``: issue 50's table of the longest functions."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from graph_exec.benchmarks.function_sizes import FunctionSize, function_sizes, main

MODULE = textwrap.dedent(
    '''
    def short():
        return 1


    class Box:
        @property
        def size(self):
            """A docstring counts.

            Every line of it.
            """
            return 2

        def outer(self):
            def inner():
                return 3

            return inner()
    '''
)


def _package(root: Path) -> Path:
    package = root / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "mod.py").write_text(MODULE)
    return package


def test_lengths_run_from_def_to_the_last_line_docstring_included_longest_first(tmp_path: Path) -> None:
    sizes = function_sizes(_package(tmp_path))
    assert sizes == [
        FunctionSize("pkg/sub/mod.py", "Box.size", 6),  # the decorator is not counted
        FunctionSize("pkg/sub/mod.py", "Box.outer", 5),
        FunctionSize("pkg/sub/mod.py", "Box.outer.inner", 2),
        FunctionSize("pkg/sub/mod.py", "short", 2),
    ]


def test_linked_folders_outside_the_package_are_not_scanned(tmp_path: Path) -> None:
    package = _package(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "big.py").write_text("def big():\n" + "    x = 1\n" * 50)
    os.symlink(elsewhere, package / "kernels")
    assert {size.name for size in function_sizes(package)} == {
        "short",
        "Box.size",
        "Box.outer",
        "Box.outer.inner",
    }


def test_the_table_lists_the_top_n(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--top", "2", "--root", str(_package(tmp_path))])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["| 6 | `pkg/sub/mod.py::Box.size` |", "| 5 | `pkg/sub/mod.py::Box.outer` |"]


def test_a_bad_top_or_root_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--top", "0"])
    assert "--top must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path / "missing")])
    assert "--root must be a directory" in capsys.readouterr().err
