"""One tower placement for ``run()`` and ``evaluate()``, and its wire tag
(:mod:`graph_exec.runtime.tower_placement`)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from graph_exec.runtime.tower_placement import EXACT_MICROS, TowerPlacement, describe_tag, placement_tag
from graph_exec.schedule import PlanConfig, StepKind, build_plan

CONFIGS = [
    PlanConfig(
        pp=pp,
        vpp=vpp,
        micro=micro,
        preprocess=pre,
        num_preprocess_layers=1,
        run_ahead=run_ahead,
        input="owned",
    )
    for pp, vpp, micro in ((2, 1, 4), (2, 2, 6), (4, 1, 8), (4, 2, 8))
    for pre in ("frozen", "trainable")
    for run_ahead in ("full", "min")
]


def _reads(config: PlanConfig, rank: int) -> set[int]:
    """The plan micros whose batch rows ``rank`` reads: its tower forwards."""
    return {s.micro for s in build_plan(config).orders[rank] if s.kind is StepKind.TFWD}


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"P{c.pp}V{c.vpp}M{c.micro}-{c.preprocess}-{c.run_ahead}"
)
def test_evaluation_reads_the_rows_the_owned_reading_placed_on_each_rank(config: PlanConfig) -> None:
    """Over random cost vectors, every batch micro-batch whose rows a rank's forward-only plan
    reads is one the training placement gave it (what ``owned_input()`` and the owned loader
    read); deciding on the forward-only plan's own slack broke this for ``run_ahead="min"``."""
    rng = random.Random(config.pp * 100 + config.micro)
    evaluation = replace(config, forward_only=True)
    placement = TowerPlacement(config.micro, "balanced")
    reads = [(_reads(evaluation, rank), _reads(config, rank)) for rank in range(config.pp)]
    for _ in range(300):
        costs = [rng.choice((0.5, 1.0, 2.0, 5.0, 10.0)) * rng.random() for _ in range(config.micro)]
        order = placement.order(config, costs)
        assert placement.order(evaluation, costs) == order
        for rank, plans in enumerate(reads):
            owned = {order[m] for m in config.owned(rank)}
            assert all({order[m] for m in micros} <= owned for micros in plans), (costs, rank)


def test_arrival_and_missing_costs_keep_the_users_order() -> None:
    config = CONFIGS[0]
    assert TowerPlacement(4, "arrival").order(config, [9.0, 1.0, 1.0, 1.0]) == (0, 1, 2, 3)
    assert TowerPlacement(4, "balanced").order(config, None) == (0, 1, 2, 3)


def test_a_tag_names_its_placement_exactly_up_to_twelve_micro_batches() -> None:
    for micro in (1, 2, 3, 4):
        tags = {placement_tag(order) for order in itertools.permutations(range(micro))}
        assert len(tags) == len(list(itertools.permutations(range(micro))))  # one tag per placement
    rng = random.Random(0)
    for micro in (5, 8, EXACT_MICROS):
        for _ in range(50):
            order = tuple(rng.sample(range(micro), micro))
            tag = placement_tag(order)
            assert 0 <= tag < 1 << 30
            assert describe_tag(tag, micro) == f"tower placement order {order}"
    assert placement_tag(tuple(range(EXACT_MICROS))) == 0  # arrival order: the wire as before


def test_above_twelve_micro_batches_the_tag_is_a_digest() -> None:
    micro = EXACT_MICROS + 4
    order = (1, 0, *range(2, micro))
    tag = placement_tag(order)
    assert tag >> 30 == 1 and tag < 1 << 31
    assert describe_tag(tag, micro).startswith("a tower placement with digest ")
    assert placement_tag(tuple(range(micro))) == 0
    assert tag != placement_tag((0, 2, 1, *range(3, micro)))
