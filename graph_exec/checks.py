"""Argument checks shared by the configuration objects, the public schedules and the CLI.

One contract for every check: ``check(name, value, error=ValueError)`` returns the value it
accepted (converted where that is the point: seconds become a ``float``) and otherwise raises
``error`` with ``"<name> must be <allowed>, got <value!r>"``. The callers pick the error class
(``PlanConfigError`` for a plan, ``ValueError`` for the public API), so the wording of what is
allowed exists once, and the CLI's argparse types reuse it through :attr:`Check.allowed`.

``bool`` is rejected wherever a number is expected: it is an ``int`` subclass, but
``micro_batch_num=True`` is a bug in the caller, not a count.

Kept free of MindSpore and of every other package module so any layer may import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class Check:
    """A named rule: ``accept`` says whether a value is allowed, ``allowed`` says it in words.

    ``convert`` turns an accepted value into what the caller stores (identity by default).
    """

    allowed: str
    accept: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value

    def __call__(self, name: str, value: Any, error: type[Exception] = ValueError) -> Any:
        """``value`` (converted) when allowed; otherwise raise ``error`` naming it and the rule."""
        if not self.accept(value):
            raise error(f"{name} must be {self.allowed}, got {value!r}")
        return self.convert(value)


integer = Check("an int", _is_int)
positive_int = Check("a positive int", lambda v: _is_int(v) and v >= 1)
non_negative_int = Check("an int >= 0", lambda v: _is_int(v) and v >= 0)
finite_non_negative = Check("a finite number >= 0", lambda v: _is_real(v) and 0 <= v < math.inf, float)
positive_number = Check("a number > 0 (or inf)", lambda v: _is_real(v) and v > 0, float)
positive_seconds = Check("a number of seconds > 0", lambda v: _is_real(v) and 0 < v < math.inf, float)
boolean = Check("a bool (True or False)", lambda v: isinstance(v, bool))


def choice(name: str, value: Any, allowed: Sequence[str], error: type[Exception] = ValueError) -> str:
    """``value`` when it is one of ``allowed``; otherwise raise ``error`` listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise error(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value
