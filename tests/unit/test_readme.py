"""README's two commands stay true: CI runs the README's test command verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = _commands((ROOT / ".ci" / "run").read_text())
    readme = _commands((ROOT / "README.md").read_text())
    assert len(ci) == 1, ci
    assert ci[0] in readme and "pytest" in ci[0]


def test_readme_main_job_runs_an_example_that_exists():
    from graph_exec.examples import EXAMPLES

    main = [c for c in _commands((ROOT / "README.md").read_text()) if "graph-exec run" in c]
    assert len(main) == 1
    assert main[0].split("graph-exec run", 1)[1].split()[0] in EXAMPLES
