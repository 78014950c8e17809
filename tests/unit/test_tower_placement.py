"""Cost-aware tower placement (``docs/schedule.md``, "Tower placement"): the decision and the
simulator's ``tower_order``."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from graph_exec.cli import main
from graph_exec.schedule import PlanConfig, PlanConfigError, build_plan
from graph_exec.schedule.placement import StepCosts, balanced_order, tower_order, tower_positions
from graph_exec.simulate import OpCosts, simulate


def test_full_run_ahead_balances_the_owners_prefix_by_hand() -> None:
    # P=2 V=1 M=4, frozen tower, F=1 B=2, Pf=1, towers 4,1,4,1. Arrival: rank 0 owns plan
    # micros 0 and 2 (towers 4+4=8), rank 1 owns 1 and 3 (1+1=2); rank 0 starts F0.0 once it
    # has every output, at 8, and the body takes (M+P-1)(F+B) = 15: 23. Balanced: one 4 and one
    # 1 per owner, both done at 5: 5 + 15 = 20.
    plan = build_plan(PlanConfig(pp=2, vpp=1, micro=4, preprocess="frozen"))
    costs = OpCosts(forward=1, backward=2, preprocess_forward=1, tower_costs=(4, 1, 4, 1))
    assert simulate(plan, costs, "arrival").step_time == 23
    balanced = simulate(plan, costs, "balanced")
    assert balanced.step_time == 20
    assert sorted(balanced.order) == [0, 1, 2, 3]
    # each owner gets one heavy (user 0 or 2) and one light (user 1 or 3) micro-batch
    owned = [{balanced.order[m] for m in plan.config.owned(r)} for r in range(2)]
    assert all(len(group & {0, 2}) == 1 and len(group & {1, 3}) == 1 for group in owned)


def test_inline_slack_is_what_the_simulator_lets_one_tower_take_for_free() -> None:
    # P=4 V=1 M=8, run_ahead="min": plan micros 4..7 run inline on rank 0. One tower of weight h at
    # inline micro m lengthens the simulated step by exactly max(0, h - slack(m)).
    config = PlanConfig(pp=4, vpp=1, micro=8, preprocess="frozen", run_ahead="min")
    plan = build_plan(config)
    positions = tower_positions(config, StepCosts(backward=2.0, fused_last_stage=False))
    assert positions.inline == (4, 5, 6, 7)
    assert positions.slack == (1.0, 3.0, 0.0, 0.0)
    base = simulate(plan, OpCosts(forward=1, backward=2)).step_time
    for m, slack in zip(positions.inline, positions.slack, strict=True):
        for h in (0.5, 1, 2, 3, 4.5):
            weights = tuple(h if i == m else 0.0 for i in range(8))
            costs = OpCosts(forward=1, backward=2, preprocess_forward=1, tower_costs=weights)
            assert simulate(plan, costs).step_time - base == pytest.approx(max(0.0, h - slack))


_ZB_STEP_COSTS = {  # what each step costs, in units of one chunk forward
    "runtime default": None,  # tower_positions(config): F 1, B 2 (I and W 1 each), last stage fused
    "measured split": {"backward": 2.0, "input_backward": 1.5, "weight_backward": 0.25},
    "measured split, last stage apart": {
        "backward": 2.0,
        "input_backward": 0.5,
        "weight_backward": 1.75,
        "fused_last_stage": False,
    },
}


@pytest.mark.parametrize("name", list(_ZB_STEP_COSTS))
@pytest.mark.parametrize("transpose", [False, True])
def test_zb_slack_prices_input_and_weight_backward_by_their_own_costs(name: str, transpose: bool) -> None:
    # Under body="zb" each inline TFWD's slack is exactly the tower the simulator lets it take
    # for free: one more (0.25) and the step is longer by that much. The slack used to price I
    # and W as a whole backward each, so the decision worked from a plan that does not run.
    given = _ZB_STEP_COSTS[name]
    step = {"backward": 2.0, "fused_last_stage": True} if given is None else given
    run_ahead = "min" if transpose else "full"  # either way some towers run inline on rank 0
    config = PlanConfig(
        pp=3, vpp=2, micro=9, body="zb", preprocess="frozen", transpose=transpose, run_ahead=run_ahead
    )
    positions = tower_positions(config) if given is None else tower_positions(config, StepCosts(**step))
    assert positions.inline
    plan = build_plan(config)
    base = simulate(plan, OpCosts(forward=1, **step)).step_time
    for m, slack in zip(positions.inline, positions.slack, strict=True):
        for extra in (0.0, 0.25):
            weights = tuple(slack + extra if i == m else 0.0 for i in range(config.micro))
            costs = OpCosts(forward=1, preprocess_forward=1, tower_costs=weights, **step)
            assert simulate(plan, costs).step_time - base == pytest.approx(extra), (m, slack)


def test_min_run_ahead_puts_the_heavy_towers_in_the_prefix_and_the_rest_into_the_slack() -> None:
    # Same plan: prefix positions 0..3 (one per rank), inline 4..7 with slack 1, 3, 0, 0.
    # Towers: 1, 2, 0.5, 0.25 and four of 4. Balanced: the 4s in the prefix (in parallel on the
    # four ranks: the body starts 4 later), 2 at the slack-3 position and 1 at the slack-1 one
    # (free), 0.5 and 0.25 on rank 0's critical path: 4 + 0.5 + 0.25 = 4.75 over the tower-free
    # step. Arrival keeps the 4s inline, at least 4 + 4 at the slack-0 positions: >= 8.
    config = PlanConfig(pp=4, vpp=1, micro=8, preprocess="frozen", run_ahead="min")
    plan = build_plan(config)
    weights = (1, 2, 0.5, 0.25, 4, 4, 4, 4)
    costs = OpCosts(forward=1, backward=2, preprocess_forward=1, tower_costs=weights)
    base = simulate(plan, OpCosts(forward=1, backward=2)).step_time
    assert simulate(plan, costs, "arrival").step_time - base >= 8
    balanced = simulate(plan, costs, "balanced")
    assert balanced.step_time - base == pytest.approx(4.75)
    assert {balanced.order[m] for m in range(4)} == {4, 5, 6, 7}
    assert balanced.order[5] == 1 and balanced.order[4] == 0


def _sweep() -> list[tuple[PlanConfig, OpCosts]]:
    rng = random.Random(7)
    cases = []
    for pp, vpp, micro, kind, run_ahead, transpose in itertools.product(
        (2, 3, 4), (1, 2), (4, 6, 8), ("frozen", "trainable"), ("full", "min"), (True, False)
    ):
        if not transpose and run_ahead == "min":
            continue
        config = PlanConfig(pp, vpp, micro, preprocess=kind, run_ahead=run_ahead, transpose=transpose)
        for _ in range(4):
            # skewed: mostly light towers, a few 4x heavier
            weights = tuple(rng.choice((1, 1, 1, 4)) for _ in range(micro))
            costs = OpCosts(
                forward=1,
                backward=rng.choice((1, 2, 3)),
                preprocess_forward=rng.choice((0.5, 2)),
                latency=rng.choice((0, 0.3)),
                fused_last_stage=rng.choice((True, False)),
                tower_costs=weights,
            )
            cases.append((config, costs))
    return cases


def test_balanced_is_never_slower_than_arrival_on_skewed_mixes() -> None:
    faster = 0
    for config, costs in _sweep():
        plan = build_plan(config)
        arrival = simulate(plan, costs, "arrival").step_time
        balanced = simulate(plan, costs, "balanced").step_time
        assert balanced <= arrival + 1e-9, (config, costs)
        faster += balanced < arrival - 1e-9
    assert faster > 50  # it does move something


def test_the_decision_is_a_permutation_deterministic_and_arrival_on_ties() -> None:
    positions = tower_positions(PlanConfig(pp=4, vpp=2, micro=8, preprocess="trainable"))
    costs = [3.0, 1.0, 7.0, 1.0, 1.0, 2.0, 9.0, 1.0]
    order = tower_order(positions, costs, "balanced")
    assert sorted(order) == list(range(8))
    assert order == tower_order(positions, list(costs), "balanced")
    assert tower_order(positions, costs, "arrival") == tuple(range(8))
    assert balanced_order(positions, [2.0] * 8) == tuple(range(8))  # nothing to gain: kept as given


def test_the_fair_baseline_decides_the_same_whatever_preprocess_a_rank_knows() -> None:
    # Ranks other than 0 of ScheduleInterleaved1F1B plan without the preprocess.
    costs = [1.0, 5.0, 1.0, 1.0, 3.0, 1.0]
    orders = {
        tower_order(
            tower_positions(PlanConfig(pp=3, vpp=2, micro=6, preprocess=kind, transpose=False)),
            costs,
            "balanced",
        )
        for kind in ("none", "frozen", "trainable")
    }
    assert len(orders) == 1


@pytest.mark.parametrize(
    ("costs", "words"),
    [
        ([1.0, 2.0], "has 2 values but there are 4 micro-batches"),
        ([1.0, -1.0, 1.0, 1.0], "tower_costs[1] = -1.0"),
        ([1.0, 1.0, math.nan, 1.0], "tower_costs[2] = nan"),
        ([1.0, 1.0, 1.0, True], "tower_costs[3] = True"),
        ("1111", "must be a sequence of 4 numbers"),
    ],
)
def test_bad_tower_costs_name_the_value(costs, words: str) -> None:
    positions = tower_positions(PlanConfig(pp=2, micro=4, preprocess="frozen"))
    with pytest.raises(PlanConfigError) as info:
        tower_order(positions, costs, "balanced")
    assert words in str(info.value)
    with pytest.raises(PlanConfigError, match="tower_order must be one of"):
        tower_order(positions, [1.0] * 4, "heaviest")


def test_cli_simulates_both_orders(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--pp", "2", "--vpp", "1", "--micro", "4", "--preprocess", "frozen"]
    assert (
        main([*args, "--pre-fwd-time", "1", "--tower-costs", "4,1,4,1", "--tower-order", "arrival,balanced"])
        == 0
    )
    out = capsys.readouterr().out
    assert "== tower order arrival\nstep time: 23\n" in out
    assert "== tower order balanced\nstep time: 20\n" in out
    assert "balanced vs arrival: step time 20 vs 23 (1.150x)" in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--pre-fwd-time", "1", "--tower-costs", "4,1"], "--tower-costs has 2 values but --micro is 4"),
        (["--pre-fwd-time", "1", "--tower-costs", "4,-1,1,1"], "finite numbers >= 0"),
        (["--tower-costs", "4,1,1,1"], "give --pre-fwd-time"),
        (["--tower-order", "balanced,heavy"], "one or more of arrival, balanced"),
    ],
)
def test_cli_refuses_bad_tower_flags(
    extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--pp", "2", "--vpp", "1", "--micro", "4", "--preprocess", "frozen", *extra]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert words in capsys.readouterr().err
