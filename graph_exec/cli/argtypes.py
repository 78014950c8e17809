"""argparse types for numbers, shared by every sub-command.

The common types apply the same rules the library applies to the values
(:mod:`graph_exec.checks`), so ``--micro 0`` and ``micro=0`` are refused with the same words.
A bad value becomes argparse's usual error (exit code 2) with a message that repeats the
value and says what is allowed; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

from graph_exec import checks


def number(parse: Callable[[str], Any], accept: Callable[[Any], bool], allowed: str) -> Callable[[str], Any]:
    """An argparse type: ``parse(text)`` if it parses and ``accept`` says yes, else an error saying ``allowed``."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {allowed}")
        return value

    convert.__name__ = allowed  # argparse names the type in some messages
    return convert


def checked(parse: Callable[[str], Any], check: checks.Check) -> Callable[[str], Any]:
    """The argparse type for values that ``check`` (from :mod:`graph_exec.checks`) accepts."""
    return number(parse, check.accept, check.allowed)


positive_int = checked(int, checks.positive_int)
non_negative_int = checked(int, checks.non_negative_int)
finite_non_negative = checked(float, checks.finite_non_negative)
positive_number = checked(float, checks.positive_number)
seconds = checked(float, checks.positive_seconds)
port = number(int, lambda v: 1024 <= v <= 65535, "a TCP port number in 1024..65535")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


#: ``--seq-len-range MIN,MAX``.
length_range = number(
    _ints, lambda v: len(v) == 2 and 1 <= v[0] <= v[1], "MIN,MAX: two ints with 1 <= MIN <= MAX"
)
#: ``--shape-buckets S1,S2,...``.
bucket_sizes = number(
    _ints,
    lambda v: all(s >= 1 for s in v) and all(a < b for a, b in itertools.pairwise(v)),
    "strictly increasing positive ints, comma-separated (e.g. 64,128,192,256)",
)

#: ``--layers N1,N2,...``: blocks per stage (a rebalanced split).
layer_counts = number(
    _ints, lambda v: all(n >= 0 for n in v), "block counts >= 0 per stage, comma-separated (e.g. 2,1,1,0)"
)


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(n) for n in part.split("x")) for part in text.split(","))  # type: ignore[misc]


#: ``--image-sizes HxW,HxW,...``: image sizes in pixels (the example checks the patch grid).
image_sizes = number(
    _sizes,
    lambda v: bool(v) and all(len(s) == 2 and min(s) >= 1 for s in v),
    "HxW sizes in pixels, comma-separated (e.g. 16x16,32x24,48x48)",
)


def _count_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


#: ``--images-per-sample LO-HI`` (or ``N``).
count_range = number(
    _count_range, lambda v: 0 <= v[0] <= v[1], "LO-HI or N: ints with 0 <= LO <= HI (e.g. 0-2)"
)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


#: ``--tower-costs W1,W2,...``: one finite weight >= 0 per micro-batch.
tower_weights = number(
    _floats,
    lambda v: all(checks.finite_non_negative.accept(w) for w in v),
    "finite numbers >= 0, comma-separated, one per micro-batch (e.g. 1,4,1,1)",
)
