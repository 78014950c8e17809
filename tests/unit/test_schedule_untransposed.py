"""The fair baseline in the schedule layer: MPipe without transposition (``transpose=False``).

Rank 0 runs ``TFWD m`` right before every ``F 0.m`` and, trainable, ``TBWD m`` right after
every ``B 0.m``; nothing is broadcast or shipped, the other ranks run exactly the body. The
validator (invariants, "strip MPipe = body", replay) runs on every build.
"""

from __future__ import annotations

import itertools

import pytest

from graph_exec.schedule import (
    InvariantError,
    Plan,
    PlanConfig,
    PlanConfigError,
    StepKind,
    build_plan,
    validate,
)
from graph_exec.simulate import OpCosts, simulate

MPIPE_KINDS = {StepKind.BCAST, StepKind.OUTSEND, StepKind.OUTRECV, StepKind.INSEND, StepKind.INRECV}


def tokens(plan: Plan, rank: int) -> str:
    return " ".join(step.token for step in plan.orders[rank])


def test_contract_example_without_transposition() -> None:
    # The contract's P=2 V=1 M=4 body with the preprocess on rank 0 next to F 0.m / B 0.m.
    plan = build_plan(PlanConfig(pp=2, micro=4, preprocess="trainable", transpose=False))
    assert tokens(plan, 0) == (
        "TFWD0 F0.0 Fsend0.0 TFWD1 F0.1 Fsend0.1 Brecv0.0 TFWD2 F0.2 Fsend0.2 B0.0 TBWD0 "
        "Brecv0.1 TFWD3 F0.3 Fsend0.3 B0.1 TBWD1 Brecv0.2 B0.2 TBWD2 Brecv0.3 B0.3 TBWD3"
    )
    assert plan.orders[1] == plan.body[1]
    frozen = build_plan(PlanConfig(pp=2, micro=4, preprocess="frozen", transpose=False))
    assert "TBWD" not in tokens(frozen, 0)
    assert tokens(frozen, 0).startswith("TFWD0 F0.0 Fsend0.0 TFWD1 F0.1")


@pytest.mark.parametrize(
    ("pp", "vpp", "micro", "preprocess", "body"),
    [
        (p, v, m, pre, body)
        for p, v, m, pre, body in itertools.product(
            (1, 2, 3, 4), (1, 2, 3), (1, 2, 3, 4, 5, 8), ("trainable", "frozen"), ("interleaved", "gpipe")
        )
    ]
    + [(p, 1, m, pre, "1f1b") for p in (2, 4) for m in (1, 3, 8) for pre in ("trainable", "frozen")],
)
def test_every_preprocess_step_sits_on_rank_0_next_to_its_stage_0_step(
    pp, vpp, micro, preprocess, body
) -> None:
    config = PlanConfig(pp=pp, vpp=vpp, micro=micro, preprocess=preprocess, body=body, transpose=False)
    plan = build_plan(config)  # validates
    assert config.nt == 1 and not config.broadcasts and not config.ships_inputs
    assert [plan.owner(m) for m in range(micro)] == [0] * micro
    for rank in range(1, pp):
        assert plan.orders[rank] == plan.body[rank]
    row = plan.orders[0]
    assert not MPIPE_KINDS & {step.kind for step in row}
    stripped = tuple(s for s in row if s.kind not in (StepKind.TFWD, StepKind.TBWD))
    assert stripped == plan.body[0]
    for i, step in enumerate(row):
        if step.kind is StepKind.TFWD:
            assert (row[i + 1].kind, row[i + 1].stage, row[i + 1].micro) == (StepKind.F, 0, step.micro)
        if step.kind is StepKind.TBWD:
            assert (row[i - 1].kind, row[i - 1].stage, row[i - 1].micro) == (StepKind.B, 0, step.micro)
    counts = {kind: sum(s.kind is kind for s in row) for kind in (StepKind.TFWD, StepKind.TBWD)}
    assert counts == {StepKind.TFWD: micro, StepKind.TBWD: micro if preprocess == "trainable" else 0}


def test_none_preprocess_without_transposition_is_the_body() -> None:
    plan = build_plan(PlanConfig(pp=3, vpp=2, micro=6, transpose=False))
    assert plan.orders == plan.body


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"run_ahead": "min"}, r"run_ahead 'min' applies to transposed micro-batches, but transpose=False"),
        ({"backward": "owner"}, r"backward 'owner' applies to transposed micro-batches"),
        ({"input": "owned"}, r"input 'owned' applies to transposed micro-batches.*default 'replicated'"),
        ({"transpose": 0}, r"transpose must be a bool \(True or False\), got 0"),
    ],
)
def test_transposition_options_are_refused_without_transposition(option, match) -> None:
    with pytest.raises(PlanConfigError, match=match):
        PlanConfig(pp=2, micro=4, preprocess="trainable", **{"transpose": False, **option})


def test_validator_catches_a_preprocess_forward_moved_away_from_f0() -> None:
    config = PlanConfig(pp=2, micro=3, preprocess="frozen", transpose=False)
    good = build_plan(config)
    row = [step.token for step in good.orders[0]]
    row.remove("TFWD2")
    row.insert(row.index("TFWD1"), "TFWD2")  # still before F0.2, but not directly
    broken = Plan.from_tokens(config, [row, [s.token for s in good.orders[1]]])
    with pytest.raises(InvariantError, match=r"without transposition, TFWD2 must directly precede F0\.2"):
        validate(broken)


def test_simulated_fair_baseline_pays_every_preprocess_on_rank_0() -> None:
    # P=2 V=1 M=2, f=b=1, Pf=2, free transfers.
    #   r0: TFWD0 0-2 | F0.0 2-3 | TFWD1 3-5 | F0.1 5-6 | B0.0 7-8 | B0.1 9-10
    #   r1: F1.0 3-4 | Frecv1.1 waits to 6 | B1.0 6-7 | F1.1 7-8 | B1.1 8-9
    # The same as the MPipe plan's body-only baseline (the preprocess folded into F 0.m).
    fair = build_plan(PlanConfig(pp=2, micro=2, preprocess="frozen", transpose=False))
    mpipe = build_plan(PlanConfig(pp=2, micro=2, preprocess="frozen"))
    costs = OpCosts(forward=1, backward=1, preprocess_forward=2)
    assert simulate(fair, costs).step_time == simulate(mpipe, costs).baseline.step_time == 10


def test_simulated_trainable_baseline_charges_the_tape_backward_not_the_recompute() -> None:
    # P=2 V=1 M=2, f=b=1, Pf=2, tape backward 0.5, recompute (MPipe TBWD) 3.
    #   fair r0: TFWD0 0-2 | F0.0 2-3 | TFWD1 3-5 | F0.1 5-6 | B0.0 7-8 | TBWD0 8-8.5 |
    #            B0.1 9-10 (gradient at 9) | TBWD1 10-10.5
    #   MPipe r0 (BCAST free): TFWD0 0-2 | F0.0 2-3 | F0.1 3-4 | B0.0 5-6 | TBWD0 6-9 |
    #            B0.1 9-10 (gradient at 7) | TBWD1 10-13
    fair = build_plan(PlanConfig(pp=2, micro=2, preprocess="trainable", transpose=False))
    mpipe = build_plan(PlanConfig(pp=2, micro=2, preprocess="trainable"))
    costs = OpCosts(forward=1, backward=1, preprocess_forward=2, preprocess_backward=0.5, recompute=3)
    assert simulate(fair, costs).step_time == 10.5
    result = simulate(mpipe, costs)
    assert result.baseline.step_time == 10.5 and result.step_time == 13
    assert result.saving == -2.5
