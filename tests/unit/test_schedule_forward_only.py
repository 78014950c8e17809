"""Forward-only (evaluation) plans: every forward once, the MPipe prefix kept, no backward."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from graph_exec.schedule import (
    CoverageError,
    InvariantError,
    Plan,
    PlanConfig,
    PlanConfigError,
    StepKind,
    buffer_lifetimes,
    build_plan,
    to_text,
    validate,
)

K = StepKind
BACKWARD_KINDS = {K.B, K.BSEND, K.BRECV, K.TBWD, K.INSEND, K.INRECV, K.GRADSEND, K.GRADRECV_BWD, K.GRADREDUCE}


def _rows(plan: Plan) -> list[list[str]]:
    return [line.split(": ", 1)[1].split() for line in to_text(plan).splitlines()]


def _configs():
    """Every option combination the training plans accept, at small sizes."""
    for pp, vpp, micro in [(1, 2, 3), (2, 1, 4), (2, 2, 5), (4, 2, 8), (4, 1, 2)]:
        for preprocess, run_ahead, backward, input_, transpose in itertools.product(
            ("trainable", "frozen", "none"),
            ("full", "min"),
            ("central", "owner"),
            ("replicated", "owned"),
            (True, False),
        ):
            try:
                yield PlanConfig(
                    pp=pp,
                    vpp=vpp,
                    micro=micro,
                    preprocess=preprocess,
                    run_ahead=run_ahead,
                    backward=backward,
                    input=input_,
                    transpose=transpose,
                )
            except PlanConfigError:
                continue


@pytest.mark.parametrize("config", list(_configs()), ids=str)
def test_every_training_configuration_has_a_valid_forward_only_plan(config: PlanConfig) -> None:
    training = build_plan(config)
    plan = build_plan(replace(config, forward_only=True))
    for rank in range(config.pp):
        kinds = [step.kind for step in plan.orders[rank]]
        assert not BACKWARD_KINDS & set(kinds), (rank, kinds)
        forwards = sorted((s.stage, s.micro) for s in plan.orders[rank] if s.kind is K.F)
        assert forwards == [
            (s, m) for s in range(rank, config.num_stages, config.pp) for m in range(config.micro)
        ]
        # The forward half of the MPipe prefix is the training plan's: same broadcast, same owners.
        for kind in (K.BCAST, K.TFWD, K.OUTSEND, K.OUTRECV):
            assert [s for s in plan.orders[rank] if s.kind is kind] == [
                s for s in training.orders[rank] if s.kind is kind
            ]
        # A receive is read by the forward that consumes it, nothing later.
        for life in buffer_lifetimes(plan, rank):
            reader = plan.orders[rank][life.last_index]
            assert reader.kind in (K.F, K.TFWD) and reader.micro == life.step.micro


def test_forward_only_order_runs_each_chunk_in_turn() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, preprocess="trainable", forward_only=True))
    expected = (
        "BCAST TFWD0 TFWD2 OUTrecv1 OUTrecv3 F0.0 Fsend0.0 F0.1 Fsend0.1 Frecv2.0 F0.2 Fsend0.2 Frecv2.1"
    )
    expected += " F0.3 Fsend0.3 Frecv2.2 F2.0 Fsend2.0 Frecv2.3 F2.1 Fsend2.1 F2.2 Fsend2.2 F2.3 Fsend2.3"
    assert _rows(plan)[0] == expected.split(" ")


def test_inline_preprocess_forwards_stay_before_their_stage_zero_forward() -> None:
    for config in (
        PlanConfig(pp=2, micro=4, preprocess="trainable", run_ahead="min", forward_only=True),
        PlanConfig(pp=2, micro=3, preprocess="frozen", transpose=False, forward_only=True),
    ):
        row = _rows(build_plan(config))[0]
        for m in range(config.micro):
            if f"TFWD{m}" in row and config.owner(m) == 0 and (not config.transpose or m >= config.nt):
                assert row[row.index(f"TFWD{m}") + 1] == f"F0.{m}"


def test_a_backward_step_in_a_forward_only_plan_is_refused() -> None:
    config = PlanConfig(pp=2, micro=2, forward_only=True)
    rows = _rows(build_plan(config))
    validate(Plan.from_tokens(config, rows))
    rows[1].append("B1.0")
    with pytest.raises((InvariantError, CoverageError)):
        validate(Plan.from_tokens(config, rows))
    missing = _rows(build_plan(config))
    missing[1].remove("F1.1")
    with pytest.raises((InvariantError, CoverageError), match=r"F1\.1"):
        validate(Plan.from_tokens(config, missing))


def test_forward_only_must_be_a_bool() -> None:
    with pytest.raises(PlanConfigError, match="forward_only must be a bool"):
        PlanConfig(pp=2, forward_only="yes")
