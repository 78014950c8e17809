"""argparse types for numbers, shared by every sub-command.

Each type parses the text and applies the same rule the library applies to the value
(:mod:`graph_exec.checks`), so ``--micro 0`` and ``micro=0`` are refused with the same words.
A bad value becomes argparse's usual error (exit code 2) with a message that repeats the
value and says what is allowed; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from graph_exec import checks


def number(parse: Callable[[str], Any], check: checks.Check) -> Callable[[str], Any]:
    """An argparse type: ``parse(text)`` if it parses and ``check`` accepts it, else a usage error."""

    def convert(text: str) -> Any:
        try:
            return check("value", parse(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {check.allowed}") from None

    convert.__name__ = check.allowed  # argparse names the type in some messages
    return convert


positive_int = number(int, checks.positive_int)
non_negative_int = number(int, checks.non_negative_int)
finite_non_negative = number(float, checks.finite_non_negative)
positive_number = number(float, checks.positive_number)
seconds = number(float, checks.positive_seconds)
