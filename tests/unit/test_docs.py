"""docs/ stays true: its worked examples are what ``graph-exec plan`` prints today."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from graph_exec.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"```text\n\$ graph-exec (plan .*?)\n(.*?)```", re.S)


def _examples() -> list[tuple[str, str]]:
    text = (DOCS / "schedule.md").read_text(encoding="utf-8")
    section = text.split("## Worked examples", 1)[1].split("\n## ", 1)[0]
    return _BLOCK.findall(section)


def test_the_worked_examples_section_has_examples() -> None:
    assert len(_examples()) >= 5


@pytest.mark.parametrize(("command", "expected"), _examples(), ids=lambda v: v[:60])
def test_worked_example_matches_the_plan(
    command: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("name", ["schedule.md", "architecture.md"])
def test_code_cites_sections_that_exist(name: str) -> None:
    """Every ``docs/<name>, "<section>"`` cited in the code names a heading of that document."""
    headings = {
        line.lstrip("#").strip()
        for line in (DOCS / name).read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    root = DOCS.parent
    cited = set()
    for path in [*root.glob("graph_exec/**/*.py"), *root.glob("tests/**/*.py")]:
        for section in re.findall(
            rf'docs/{re.escape(name)}``?,\s*(?:section\s*)?"([^"]+)"', path.read_text()
        ):
            cited.add((" ".join(section.split()), str(path.relative_to(root))))
    assert cited, f"nothing cites docs/{name}"
    missing = sorted(c for c in cited if c[0] not in headings)
    assert not missing, f"citations of sections docs/{name} does not have: {missing}"


def test_every_step_kind_has_its_one_line() -> None:
    """Each ``StepKind`` member is preceded by a ``#:`` line saying what it does and where."""
    import inspect

    from graph_exec.schedule import StepKind

    source = inspect.getsource(StepKind).splitlines()
    undocumented = [
        kind.name
        for kind in StepKind
        for i, line in enumerate(source)
        if line.strip().startswith(f"{kind.name} = ") and not source[i - 1].strip().startswith("#: ")
    ]
    assert not undocumented
