"""``--help`` that shows every default: each option whose help does not already say its default
gets ``(default: VALUE)``, so the text cannot drift from the value argparse uses; and usage
errors said in one line, with where the help is, instead of argparse's whole usage block."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class BriefErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors print the error and "see PROG --help" (exit 2):
    argparse's usage block of ``graph-exec run`` is 17 lines above the one line that matters."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\nsee {self.prog} --help\n")
        sys.exit(2)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Like :class:`argparse.ArgumentDefaultsHelpFormatter`, but leaves alone options whose help
    already names their default (often in words: "default 2 x pipeline ranks"), flags (off by
    default, or on for ``--no-...``) and options without a default (``None``: not set)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text.lower()
            or not action.option_strings
            or action.nargs == 0
            or action.default in (None, argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"
