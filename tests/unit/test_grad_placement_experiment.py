"""The early ship-back placement of ``graph_exec.benchmarks.grad_placement`` (an experiment, not
an option): its plans must validate, hold the contract's steps, and move what it says it moved."""

from __future__ import annotations

import pytest

from graph_exec.benchmarks.grad_placement import MEASURED, early_plan, tail_after_rank0_body
from graph_exec.schedule import PlanConfig, build_plan, validate
from graph_exec.simulate import simulate


@pytest.mark.parametrize(("pp", "vpp", "micro"), [(2, 2, 4), (4, 2, 8), (4, 1, 16)])
def test_early_plan_validates_and_keeps_every_step(pp: int, vpp: int, micro: int) -> None:
    config = PlanConfig(pp=pp, vpp=vpp, micro=micro, preprocess="trainable", backward="owner")
    contract = build_plan(config)
    plan, left = early_plan(config)
    validate(plan)
    assert [sorted(row) for row in plan.order_codes] == [sorted(row) for row in contract.order_codes]
    moved = [
        rank
        for rank, (mine, theirs) in enumerate(zip(plan.order_codes, contract.order_codes, strict=True))
        if mine != theirs
    ]
    owned_elsewhere = sum(1 for m in range(micro) if config.owner(m) != 0)
    assert (0 in moved) == (left < owned_elsewhere)


def test_two_ranks_move_all_but_the_last_ship_back_and_shorten_the_tail() -> None:
    config = PlanConfig(pp=2, vpp=2, micro=4, preprocess="trainable", backward="owner")
    plan, left = early_plan(config)
    tokens = [step.token for step in plan.orders[1]]
    assert left == 1 and tokens.index("GRADrecv+bwd1") < tokens.index("B1.3")
    contract, early = simulate(build_plan(config), MEASURED), simulate(plan, MEASURED)
    assert tail_after_rank0_body(early) < tail_after_rank0_body(contract)
