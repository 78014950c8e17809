"""PlanConfig: defaults, the T rules, P=1, and every rejected value with a clear message."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from graph_exec.errors import GraphExecError
from graph_exec.schedule import PlanConfig, PlanConfigError, StepKind, build_plan, to_text


def test_defaults_describe_a_plain_interleaved_body() -> None:
    config = PlanConfig(pp=4)
    assert (config.vpp, config.micro, config.preprocess, config.num_preprocess_layers) == (1, 4, "none", 0)
    assert (config.run_ahead, config.backward, config.input, config.body) == (
        "full",
        "central",
        "replicated",
        "interleaved",
    )
    assert not config.mpipe
    assert PlanConfig(pp=2, preprocess="frozen").num_preprocess_layers == 1


def test_plan_config_error_is_a_value_error_of_this_library() -> None:
    assert issubclass(PlanConfigError, ValueError)
    assert issubclass(PlanConfigError, GraphExecError)


@pytest.mark.parametrize("field", ["pp", "vpp", "micro"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_counts_must_be_positive_ints(field: str, value: object) -> None:
    if field == "micro" and value is None:
        return  # micro=None is the documented default (M = P)
    kwargs = {"pp": 2, field: value}
    with pytest.raises(PlanConfigError, match=rf"{field} must be a positive int, got {value!r}"):
        PlanConfig(**kwargs)


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_layers_must_be_a_non_negative_int(value: object) -> None:
    with pytest.raises(PlanConfigError, match=rf"num_preprocess_layers must be an int >= 0, got {value!r}"):
        PlanConfig(pp=2, preprocess="trainable", num_preprocess_layers=value)


def test_t_rules() -> None:
    with pytest.raises(
        PlanConfigError, match=r"preprocess 'none' is dataload only \(T=0\), got num_preprocess_layers=2"
    ):
        PlanConfig(pp=2, preprocess="none", num_preprocess_layers=2)
    for preprocess in ("trainable", "frozen"):
        with pytest.raises(
            PlanConfigError, match=rf"preprocess '{preprocess}' needs num_preprocess_layers >= 1"
        ):
            PlanConfig(pp=2, preprocess=preprocess, num_preprocess_layers=0)
    assert PlanConfig(pp=2, preprocess="trainable", num_preprocess_layers=3).num_preprocess_layers == 3


@pytest.mark.parametrize(
    ("field", "allowed"),
    [
        ("preprocess", "'trainable', 'frozen', 'none'"),
        ("run_ahead", "'full', 'min'"),
        ("backward", "'central', 'owner'"),
        ("input", "'replicated', 'owned'"),
        ("body", "'interleaved', '1f1b', 'gpipe', 'zb'"),
    ],
)
def test_unknown_names_list_what_is_allowed(field: str, allowed: str) -> None:
    with pytest.raises(PlanConfigError) as info:
        PlanConfig(pp=2, **{field: "bogus"})
    assert str(info.value) == f"{field} must be one of {allowed}, got 'bogus'"


@pytest.mark.parametrize("preprocess", ["frozen", "none"])
def test_owner_backward_needs_a_trainable_preprocess(preprocess: str) -> None:
    with pytest.raises(
        PlanConfigError,
        match=rf"backward 'owner' needs preprocess 'trainable', got preprocess '{preprocess}'",
    ):
        PlanConfig(pp=2, preprocess=preprocess, backward="owner")


def test_plain_1f1b_needs_one_chunk() -> None:
    with pytest.raises(PlanConfigError, match=r"body '1f1b' .* needs vpp=1, got vpp=2"):
        PlanConfig(pp=2, vpp=2, body="1f1b")


def test_index_limit() -> None:
    with pytest.raises(PlanConfigError, match="at most"):
        PlanConfig(pp=2, micro=(1 << 28) + 1)


@pytest.mark.parametrize(("option", "value"), [("backward", "owner"), ("input", "owned")])
def test_single_rank_rejects_options_that_need_a_peer(option: str, value: str) -> None:
    with pytest.raises(PlanConfigError) as info:
        PlanConfig(pp=1, micro=4, preprocess="trainable", **{option: value})
    message = str(info.value)
    assert f"{option} '{value}' needs a peer rank, but pp=1" in message
    assert "runs the preprocess inline (TFWD before the body, TBWD after B 0.m)" in message


def test_single_rank_runs_the_preprocess_inline_without_broadcast() -> None:
    # Body: rounds [1, 1], warmup min(1, 4) = 1: F0.0 | F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 | · B0.1.
    # NT = 1: TFWD0 up front, TFWD1 inline before F0.1 (min), TBWD after each B0.m, no BCAST.
    plan = build_plan(PlanConfig(pp=1, vpp=2, micro=2, preprocess="trainable", run_ahead="min"))
    assert to_text(plan) == "r0: TFWD0 F0.0 F1.0 B1.0 TFWD1 F0.1 B0.0 TBWD0 F1.1 B1.1 B0.1 TBWD1\n"
    frozen = build_plan(PlanConfig(pp=1, micro=2, preprocess="frozen"))
    assert [s.kind for s in frozen.orders[0]].count(StepKind.TFWD) == 2
    assert StepKind.BCAST not in {s.kind for s in frozen.orders[0]}


def test_the_old_name_overflow_is_taken_for_run_ahead_with_a_warning():
    """``PlanConfig(overflow=...)`` in users' code keeps working; inside, only ``run_ahead``."""
    with pytest.warns(DeprecationWarning, match=r"overflow=.*run_ahead="):
        old = PlanConfig(pp=2, micro=4, preprocess="frozen", overflow="min")
    assert old == PlanConfig(pp=2, micro=4, preprocess="frozen", run_ahead="min")
    assert replace(old, forward_only=True).run_ahead == "min"
    assert "overflow" not in {f.name for f in fields(PlanConfig)}
    with pytest.raises(PlanConfigError, match="disagree"):
        PlanConfig(pp=2, preprocess="frozen", run_ahead="min", overflow="full")
