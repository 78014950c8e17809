"""The longest functions of graph_exec, so issue 50's "longest functions" table is reproducible.

A function's length is its lines from ``def`` (decorators excluded) to its last line, docstring
included, as :mod:`ast` sees them: the number a reader scrolls through. Nested functions count
inside their parent and are also listed on their own.

Run ``python -m graph_exec.benchmarks.function_sizes [--top N] [--root DIR]``.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FunctionSize:
    """One function: where it is and how many lines it spans."""

    path: str
    name: str
    lines: int


def _qualified(tree: ast.AST, path: str) -> list[FunctionSize]:
    """Every function of one module, named ``Class.method`` / ``outer.inner`` as Python does."""
    found: list[FunctionSize] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                span = child.end_lineno - child.lineno + 1
                found.append(FunctionSize(path, name, span))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def function_sizes(root: Path = _PACKAGE) -> list[FunctionSize]:
    """All functions under ``root``, longest first (ties by path and name, so runs agree)."""
    sizes: list[FunctionSize] = []
    for file in sorted(root.rglob("*.py")):
        if any((root / folder).is_symlink() for folder in file.relative_to(root).parents):
            continue  # the git-ignored kernels/examples links point outside the package
        relative = file.relative_to(root.parent).as_posix()
        sizes.extend(_qualified(ast.parse(file.read_text(), str(file)), relative))
    return sorted(sizes, key=lambda size: (-size.lines, size.path, size.name))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--top must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    """Print the ``--top`` longest functions as a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=_positive, default=15, help="how many to list (default 15)")
    parser.add_argument("--root", type=Path, default=_PACKAGE, help="package directory to scan")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root must be a directory, got {args.root}")
    print("| lines | function |")
    print("|---:|---|")
    for size in function_sizes(args.root)[: args.top]:
        print(f"| {size.lines} | `{size.path}::{size.name}` |")


if __name__ == "__main__":
    main()
