"""The layers import downwards only: the command line sits on top, nothing below imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import graph_exec

PACKAGE = Path(graph_exec.__file__).parent
#: Packages below the command line (they run inside the workers or in users' programs).
BELOW_CLI = ("harness", "report", "checkpoint", "runtime", "executors", "transport", "schedule")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_nothing_below_the_command_line_imports_it():
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(path) if m.startswith("graph_exec.cli")
        )
        for layer in BELOW_CLI
        for path in sorted((PACKAGE / layer).rglob("*.py"))
    }
    assert {name: mods for name, mods in upward.items() if mods} == {}
