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


#: Where each part of the installed package lives in the repository (kernels/ installs as
#: graph_exec.kernels, pyproject's package-dir; graph_exec/kernels is only a helper symlink).
SOURCES = {"graph_exec": PACKAGE, "graph_exec.kernels": PACKAGE.parent / "kernels"}


def module_files() -> dict[str, Path]:
    """Every module of graph_exec and graph_exec.kernels by dotted name, read from the source."""
    modules = {}
    for prefix, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if prefix == "graph_exec" and parts[0] in ("kernels", "examples"):
                continue  # symlinks to the top-level folders, read from there
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere (top, function, TYPE_CHECKING): a
    circle broken by hiding one import in a function or behind TYPE_CHECKING is still a circle."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                    ).strip(".")
                for alias in node.names:  # `from pkg import sub` imports the submodule
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def without_parent_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without a package's own ``__init__`` re-exporting its submodules: ``from
    graph_exec.schedule import codes`` inside graph_exec.schedule.plan is an edge to codes, and
    the package importing its members is how a package is made, not a circle."""
    return {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}


def test_the_import_graph_has_no_circle():
    graph = without_parent_packages(import_graph())
    assert len(graph) > 100  # the reader found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_schedule_layer_never_imports_mindspore():
    schedule = [p for name, p in module_files().items() if name.startswith("graph_exec.schedule")]
    assert len(schedule) > 10
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] == "mindspore"
        )
        for path in schedule
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
