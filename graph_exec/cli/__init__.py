"""The ``graph-exec`` command: one sub-command per module in this package.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning the exit code). Modules are imported
only when the command line names them, so ``graph-exec plan`` never imports MindSpore.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

from graph_exec.cli.helpformat import BriefErrorParser, DefaultsHelpFormatter

#: Sub-command name -> module (relative to this package) that implements it.
COMMANDS = {
    "plan": ".plan",
    "simulate": ".simulate",
    "run": ".run",
    "bench": ".bench",
    "tune": ".tune",
    "export": ".export",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only`` set, import and register just that sub-command."""
    parser = BriefErrorParser(
        prog="graph-exec",
        description="Plan, simulate, run and benchmark MPipe Transpose pipelines on MindSpore.",
    )
    sub = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        parser_class=functools.partial(BriefErrorParser, formatter_class=DefaultsHelpFormatter),
    )
    for name, module in COMMANDS.items():
        if only is None or only == name:
            importlib.import_module(module, __name__).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    return int(args.func(args) or 0)
