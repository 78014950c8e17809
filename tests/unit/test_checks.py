"""The shared argument checks: one contract (return the value or raise naming it), one wording."""

from __future__ import annotations

import argparse
import math

import pytest

from graph_exec import checks
from graph_exec.cli import argtypes
from graph_exec.schedule import PlanConfig, PlanConfigError


@pytest.mark.parametrize(
    ("check", "good", "bad"),
    [
        (checks.positive_int, [1, 7, 2**40], [0, -1, 1.0, True, "2", None]),
        (checks.non_negative_int, [0, 3], [-1, 0.0, False, "0"]),
        (checks.finite_non_negative, [0, 0.5, 3], [-0.1, math.inf, math.nan, True, "1"]),
        (checks.positive_number, [1e-9, 2, math.inf], [0, -1, math.nan, False]),
        (checks.positive_seconds, [0.1, 300], [0, -5, math.inf, math.nan, True, "300"]),
        (checks.boolean, [True, False], [0, 1, None, "yes"]),
    ],
)
def test_each_check_returns_what_it_accepts_and_names_what_it_refuses(
    check: checks.Check, good: list[object], bad: list[object]
) -> None:
    for value in good:
        assert check("x", value) == value
    for value in bad:
        with pytest.raises(ValueError) as info:
            check("x", value)
        assert str(info.value) == f"x must be {check.allowed}, got {value!r}"


def test_seconds_come_back_as_float() -> None:
    result = checks.positive_seconds("timeout_s", 5)
    assert result == 5.0 and isinstance(result, float)


def test_the_caller_chooses_the_error_class() -> None:
    with pytest.raises(PlanConfigError, match=r"^pp must be a positive int, got 0$"):
        checks.positive_int("pp", 0, PlanConfigError)


def test_choice_lists_what_is_allowed() -> None:
    assert checks.choice("mode", "graph", ("graph", "pynative")) == "graph"
    for value in ("eager", 1, None):
        with pytest.raises(ValueError) as info:
            checks.choice("mode", value, ("graph", "pynative"))
        assert str(info.value) == f"mode must be one of 'graph', 'pynative', got {value!r}"


def test_plan_config_and_cli_use_the_same_words() -> None:
    with pytest.raises(PlanConfigError) as info:
        PlanConfig(pp=0)
    with pytest.raises(argparse.ArgumentTypeError) as cli:
        argtypes.positive_int("0")
    assert checks.positive_int.allowed in str(info.value)
    assert str(cli.value) == f"invalid value '0': must be {checks.positive_int.allowed}"


@pytest.mark.parametrize(
    ("argtype", "text", "value"),
    [
        (argtypes.positive_int, "3", 3),
        (argtypes.non_negative_int, "0", 0),
        (argtypes.finite_non_negative, "0.25", 0.25),
        (argtypes.positive_number, "inf", math.inf),
        (argtypes.seconds, "1.5", 1.5),
    ],
)
def test_cli_types_parse_good_text(argtype: object, text: str, value: float) -> None:
    assert argtype(text) == value


@pytest.mark.parametrize(
    ("argtype", "text"),
    [
        (argtypes.positive_int, "1.5"),
        (argtypes.positive_int, "0"),
        (argtypes.non_negative_int, "-1"),
        (argtypes.finite_non_negative, "nan"),
        (argtypes.positive_number, "0"),
        (argtypes.seconds, "inf"),
        (argtypes.seconds, "soon"),
    ],
)
def test_cli_types_refuse_bad_text_naming_it(argtype: object, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"invalid value '{text}': must be "):
        argtype(text)
