"""What README.md claims stays true: its command lines parse (and the quick ones run), every flag
it names exists on the sub-command it names it for, and every benchmark script it or the
performance record points to exists. (The Usage code itself is tested by ``test_readme_usage``
and, as a script, under msrun by ``tests/multirank/test_train_custom.py``.)"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from graph_exec.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: Sub-commands that only plan or simulate: quick and without MindSpore, so their lines run.
RUNNABLE = ("plan", "simulate")


def _bash_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        joined = block.replace("\\\n", " ")
        lines += [line.strip() for line in joined.splitlines()]
    return lines


def _graph_exec_commands() -> list[list[str]]:
    """Every ``graph-exec SUB ...`` command of README's bash blocks, without comments."""
    out = []
    for line in _bash_lines():
        for part in line.split("&&"):
            part = part.split("#", 1)[0].strip()
            if part.startswith("graph-exec "):
                out.append(shlex.split(part)[1:])
    return out


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def _has_flag(command: str, flag: str) -> bool:
    return re.search(rf"{re.escape(flag)}(?![\w-])", _help(command)) is not None


def _help(command: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
        build_parser(command).parse_args([command, "--help"])
    return buffer.getvalue()


def test_the_readme_shows_every_sub_command() -> None:
    assert {argv[0] for argv in _graph_exec_commands()} == set(COMMANDS)


@pytest.mark.parametrize("argv", _graph_exec_commands(), ids=" ".join)
def test_every_command_line_parses_and_the_quick_ones_run(argv: list[str], capsys) -> None:
    if argv[0] in RUNNABLE:
        assert main(argv) == 0
        assert capsys.readouterr().out
    else:  # a launch: its arguments must parse; running it is the multi-rank tests' job
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == argv[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_the_command_line_section_names_exists(command: str) -> None:
    """Each bullet of "Command line" that starts with a sub-command names only its flags."""
    section = _section("Command line")
    bullet = re.search(rf"^- `{command}\b.*?(?=^- `|\Z)", section, re.S | re.M)
    assert bullet, f"no bullet for {command}"
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", bullet.group(0)))
    assert named
    missing = sorted(flag for flag in named if not _has_flag(command, flag))
    assert not missing, f"README names flags graph-exec {command} does not have: {missing}"


def test_every_flag_named_with_graph_exec_run_elsewhere_exists() -> None:
    text = README.replace("\n", " ")
    named = set()
    for mention in re.findall(r"graph-exec run(?:\|bench)? ((?:`?--[a-z-]+[^,;.)]*)+)", text):
        named |= set(re.findall(r"--[a-z][a-z-]*", mention))
    missing = sorted(flag for flag in named if not _has_flag("run", flag))
    assert not missing, missing


def test_every_benchmark_script_named_exists_and_answers_help() -> None:
    docs = README + (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    names = set(re.findall(r"graph_exec\.benchmarks\.([a-z_]+)", docs))
    assert names
    for name in sorted(names):
        module = importlib.import_module(f"graph_exec.benchmarks.{name}")
        assert module.__doc__, name


def test_the_api_reference_example_of_plans_runs(capsys) -> None:
    """docs/api.md's plan-and-simulate example needs nothing but the library: run it."""
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = api.split("\n## Plans and the simulator\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    exec(compile(code, "docs/api.md", "exec"), {})
    assert float(capsys.readouterr().out) > 0


def test_the_api_reference_names_every_public_name() -> None:
    import graph_exec

    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in graph_exec.__all__ if name != "__version__" and name not in api]
    assert not missing, missing
