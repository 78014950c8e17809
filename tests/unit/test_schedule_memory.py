"""The schedule's memory model against counts derived by hand from the schedules' definitions."""

from __future__ import annotations

import pytest

from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.schedule.body import _rounds
from graph_exec.schedule.memory import (
    ItemSizes,
    backward_steps,
    bytes_by_step,
    held_items,
    peak_bytes,
    peak_counts,
)


@pytest.mark.parametrize(("pp", "micro"), [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_plain_1f1b_holds_p_minus_r_micro_batches_on_rank_r(pp: int, micro: int) -> None:
    plan = build_plan(PlanConfig(pp=pp, micro=micro, body="1f1b"))
    assert [peak_counts(plan, r)["activations"] for r in range(pp)] == [pp - r for r in range(pp)]


@pytest.mark.parametrize(
    ("pp", "vpp", "micro"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 6), (4, 3, 12), (4, 2, 4)]
)
def test_interleaved_holds_its_warm_up_plus_one(pp: int, vpp: int, micro: int) -> None:
    """Rank r's warm-up runs ``(V-1)·R + 2(P-1-r)`` forwards (R: the first round's micro-batches,
    ``docs/schedule.md``, "Interleaved 1F1B"); the first steady forward comes before the first
    backward frees anything, so the peak is one more, capped by the ``V·M`` forwards there are."""
    plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro))
    first_round = _rounds(pp, micro)[0]
    expected = [min((vpp - 1) * first_round + 2 * (pp - 1 - r) + 1, vpp * micro) for r in range(pp)]
    assert [peak_counts(plan, r)["activations"] for r in range(pp)] == expected


def test_gpipe_holds_every_micro_batch_but_the_fused_last_stage() -> None:
    plan = build_plan(PlanConfig(pp=4, vpp=2, micro=8, body="gpipe"))
    assert [peak_counts(plan, r)["activations"] for r in range(4)] == [16, 16, 16, 9]


def test_an_owner_holds_its_preprocess_outputs_until_it_ships_them() -> None:
    """MPipe ``full`` at P = 2, M = 4: rank 1 owns micro-batches 1 and 3 and runs both towers
    before its first body step, so it holds two outputs; ``min`` runs one ahead."""
    full = build_plan(PlanConfig(pp=2, micro=4, preprocess="frozen", num_preprocess_layers=1))
    low = build_plan(PlanConfig(pp=2, micro=4, preprocess="frozen", num_preprocess_layers=1, run_ahead="min"))
    assert peak_counts(full, 1)["preprocess outputs"] == 2
    assert peak_counts(low, 1)["preprocess outputs"] == 1
    assert all(peak_counts(full, r)["preprocess tapes"] == 0 for r in range(2))  # frozen: nothing taped


def test_kept_preprocess_tapes_last_until_their_backward() -> None:
    config = PlanConfig(pp=2, micro=4, preprocess="trainable", num_preprocess_layers=1, backward="owner")
    plan = build_plan(config)
    tapes = [it for it in held_items(plan, 1, keep_preprocess_tape=True) if it.kind == "preprocess tapes"]
    order = [str(s) for s in plan.order(1)]
    assert [(order[it.start], order[it.end]) for it in tapes] == [
        ("TFWD1", "GRADrecv+bwd1"),
        ("TFWD3", "GRADrecv+bwd3"),
    ]
    assert peak_counts(plan, 1)["preprocess tapes"] == 0  # not kept unless asked


def test_peak_bytes_is_the_peak_of_the_sum_not_the_sum_of_peaks() -> None:
    """Rank 1 of MPipe full at P = 2, M = 4 holds its two tower outputs only before its first
    body step, and one stage-1 activation at a time after: the peak is max(2·out, act + input)."""
    plan = build_plan(PlanConfig(pp=2, micro=4, preprocess="frozen", num_preprocess_layers=1))
    sizes = ItemSizes(activations={1: 100}, stage_inputs={1: 10}, preprocess_output=1000)
    assert peak_bytes(plan, 1, sizes) == 2000
    sizes = ItemSizes(activations={1: 5000}, stage_inputs={1: 10}, preprocess_output=1000)
    assert peak_bytes(plan, 1, sizes) == 5010  # one activation and the input it was received into


def test_forward_only_plans_hold_no_activations() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, forward_only=True))
    assert all(peak_counts(plan, r)["activations"] == 0 for r in range(2))


def test_negative_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"activations\[2\] must be >= 0"):
        ItemSizes(activations={2: -1}, stage_inputs={})
    with pytest.raises(ValueError, match="preprocess_output must be >= 0"):
        ItemSizes(activations={}, stage_inputs={}, preprocess_output=-5)


def test_bytes_by_step_is_the_timeline_whose_peak_is_peak_bytes() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, body="zb"))
    sizes = ItemSizes(
        activations={0: 100, 1: 200, 2: 300, 3: 50}, stage_inputs={1: 7, 3: 9}, output_gradients={1: 11}
    )
    for rank in range(2):
        timeline = bytes_by_step(plan, rank, sizes)
        assert len(timeline) == len(plan.order_codes[rank])
        assert max(timeline) == peak_bytes(plan, rank, sizes)
        assert timeline[-1] > 0  # the last W reads its activations: held through it


def test_backward_steps_name_the_steps_that_compute_a_backward() -> None:
    """Rank 1 of zero bubble at P = 2, V = 2 holds stages 1 and 3 (the last): ``F3.m`` is the
    fused forward, loss and ``I``; ``I3.m`` only routes; ``I1.m`` and every ``W`` compute."""
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, body="zb"))
    named = {str(step): phase for step, phase in zip(plan.order(1), backward_steps(plan, 1), strict=True)}
    assert named["F3.0"] == ("fused", 3) and named["F1.0"] is None
    assert named["I3.0"] is None and named["I1.0"] == ("I", 1)
    assert named["W3.0"] == ("W", 3) and named["W1.0"] == ("W", 1)
    assert named["Frecv1.0"] is None and named["Bsend1.0"] is None
    whole = build_plan(PlanConfig(pp=2, micro=4, body="1f1b"))
    assert [p for p in backward_steps(whole, 0) if p] == [("B", 0)] * 4
    assert [p for p in backward_steps(whole, 1) if p] == [("fused", 1)] * 4
    only = build_plan(PlanConfig(pp=2, micro=4, forward_only=True))
    assert backward_steps(only, 0) == [None] * len(only.order_codes[0])
