"""argparse types for numbers, shared by every sub-command.

A bad value becomes argparse's usual error (exit code 2) with a message that repeats the
value and says what is allowed; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

Number = TypeVar("Number", int, float)


def number(
    parse: Callable[[str], Number], accept: Callable[[Number], bool], allowed: str
) -> Callable[[str], Number]:
    """An argparse type: ``parse(text)`` if it parses and ``accept`` says yes, else an error saying ``allowed``."""

    def convert(text: str) -> Number:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {allowed}")
        return value

    convert.__name__ = allowed  # argparse names the type in some messages
    return convert


positive_int = number(int, lambda v: v >= 1, "a positive integer (1, 2, …)")
non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0")
finite_non_negative = number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
positive_number = number(float, lambda v: v > 0, "a number > 0 (or inf)")
seconds = number(float, lambda v: 0 < v < math.inf, "a number of seconds > 0")
port = number(int, lambda v: 1024 <= v <= 65535, "a TCP port number in 1024..65535")
