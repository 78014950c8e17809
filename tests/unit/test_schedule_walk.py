"""The one replay of a plan (``docs/schedule.md``, "Replaying a plan"): buffered and rendezvous
transfers, times under a cost rule, a dependency-respecting replay order."""

from __future__ import annotations

import pytest

from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.schedule.codes import PAIR_DELTA, encode_step, kind_base
from graph_exec.schedule.costs import OpCosts, step_cost
from graph_exec.schedule.steps import Step
from graph_exec.schedule.walk import walk


def rows(*ranks: str) -> list[list[int]]:
    return [[encode_step(Step.parse(token)) for token in rank.split()] for rank in ranks]


# Both ranks send before they receive: a transport that buffers finishes, a rendezvous one
# (the validator's) deadlocks with each rank at its send.
CROSSED = rows("F0.0 Fsend0.0 Brecv0.0 B0.0", "Bsend1.0 Frecv1.0 F1.0 B1.0")


def test_buffered_sends_finish_where_rendezvous_deadlocks() -> None:
    assert walk(CROSSED).complete(CROSSED)
    stuck = walk(CROSSED, rendezvous=True)
    assert not stuck.complete(CROSSED)
    assert stuck.pos == [1, 0]


def test_a_rendezvous_walk_stops_at_the_first_stop_it_reaches() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=1, micro=2))
    stop = [None, 3]
    result = walk(plan.order_codes, rendezvous=True, stop_at=stop)
    assert result.stopped == (1, 3)
    assert walk(plan.order_codes, rendezvous=True).complete(plan.order_codes)


def test_times_follow_the_cost_rule_and_transfers_travel() -> None:
    # P=2 M=1: F0 (1) -> message (0.5) -> F1 (1) -> B1 (2) -> message (0.5) -> B0 (2) = 7.
    plan = build_plan(PlanConfig(pp=2, vpp=1, micro=1))
    costs = OpCosts(forward=1, backward=2, latency=0.5)
    result = walk(plan.order_codes, step_cost(costs, plan.config, (1.0,)), record=True)
    assert max(row[-1][2] for row in result.steps) == pytest.approx(7.0)
    assert result.busy == [3.0, 3.0]


def test_the_replay_order_puts_every_step_after_what_it_waits_for() -> None:
    plan = build_plan(PlanConfig(pp=3, vpp=2, micro=6, preprocess="trainable", backward="owner"))
    result = walk(plan.order_codes, step_cost(OpCosts(), plan.config, (1.0,) * 6), record=True)
    when = {place: n for n, group in enumerate(result.replay) for place in group}
    assert len(when) == sum(map(len, plan.order_codes))
    for rank, row in enumerate(plan.order_codes):
        assert all(when[rank, i] < when[rank, i + 1] for i in range(len(row) - 1))
    receive_at = {code: (r, i) for r, row in enumerate(plan.order_codes) for i, code in enumerate(row)}
    for rank, row in enumerate(plan.order_codes):
        for i, code in enumerate(row):
            if kind_base(code) in PAIR_DELTA:
                assert when[rank, i] < when[receive_at[code + PAIR_DELTA[kind_base(code)]]]


def test_a_rendezvous_walk_takes_no_costs() -> None:
    with pytest.raises(ValueError, match="a rendezvous walk is untimed"):
        walk(CROSSED, lambda code: 1.0, rendezvous=True)
    with pytest.raises(ValueError, match="stop_at applies to rendezvous walks only"):
        walk(CROSSED, stop_at=[None, None])
