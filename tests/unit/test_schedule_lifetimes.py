"""Receive-buffer lifetimes: from the receive to the last step that reads the data."""

from __future__ import annotations

import random

from graph_exec.schedule import BufferLifetime, PlanConfig, Step, StepKind, buffer_lifetimes, build_plan

K = StepKind


def _spans(plan, rank: int) -> list[tuple[str, str]]:
    row = plan.orders[rank]
    return [(life.step.token, row[life.last_index].token) for life in buffer_lifetimes(plan, rank)]


def test_contract_example_lifetimes() -> None:
    plan = build_plan(
        PlanConfig(pp=2, vpp=1, micro=4, preprocess="trainable", run_ahead="min", input="owned")
    )
    # Rank 0: stage-0 inputs live until the backward that recomputes from them; the shipped raw
    # input until TBWD; the gradient from stage 1 until B.
    assert _spans(plan, 0) == [
        ("OUTrecv1", "B0.1"),
        ("INrecv1", "TBWD1"),
        ("Brecv0.0", "B0.0"),
        ("Brecv0.1", "B0.1"),
        ("Brecv0.2", "B0.2"),
        ("Brecv0.3", "B0.3"),
    ]
    # Rank 1 holds the last stage: its fused forward+loss+backward at F is the last reader.
    assert _spans(plan, 1) == [(f"Frecv1.{m}", f"F1.{m}") for m in range(4)]
    first = buffer_lifetimes(plan, 0)[0]
    assert first == BufferLifetime(Step.parse("OUTrecv1"), 2, plan.orders[0].index(Step.parse("B0.1")))


def test_middle_stage_inputs_live_until_backward_and_grads_are_consumed_at_once() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=2, preprocess="trainable", backward="owner"))
    spans = dict(_spans(plan, 1))
    assert spans["Frecv1.0"] == "B1.0"  # stage 1 is not the last stage (3 is)
    assert spans["Frecv3.0"] == "F3.0"
    assert spans["Brecv1.0"] == "B1.0"
    assert spans["GRADrecv+bwd1"] == "GRADrecv+bwd1"


def test_rules_hold_on_random_plans() -> None:
    rng = random.Random(7)
    for _ in range(40):
        pp = rng.randint(2, 6)
        config = PlanConfig(
            pp=pp,
            vpp=rng.randint(1, 3),
            micro=rng.randint(1, 3 * pp),
            preprocess="trainable",
            input=rng.choice(["owned", "replicated"]),
            run_ahead=rng.choice(["full", "min"]),
        )
        plan = build_plan(config)
        for rank in range(pp):
            lives = buffer_lifetimes(plan, rank)
            receives = [s for s in plan.orders[rank] if s.kind.value.endswith(("recv", "recv+bwd"))]
            assert [life.step for life in lives] == receives
            for life in lives:
                assert plan.orders[rank][life.recv_index] == life.step
                assert life.last_index > life.recv_index
                reader = plan.orders[rank][life.last_index]
                assert reader.micro == life.step.micro
                assert reader.kind in (K.F, K.B, K.TBWD)
