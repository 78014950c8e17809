"""The per-rank peak predicted as a timeline: held bytes, tapes and backward transients summed
step by step, not peak by peak (``runtime/tape_calibration.tape_stats``)."""

from __future__ import annotations

import pytest

from graph_exec.runtime.tape_calibration import TapeCalibration, tape_stats
from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.schedule.memory import ItemSizes, backward_steps, bytes_by_step


def _calibrated(tapes: dict[int, int], transients: dict[int, dict[str, int]]) -> TapeCalibration:
    calibration = TapeCalibration()
    calibration.tapes, calibration.transients, calibration.base_in_use = tapes, transients, 1000
    return calibration


def test_zero_bubble_parts_that_peak_apart_are_not_added_together() -> None:
    """Rank 1 of zero bubble at P = 2, V = 2: the tapes peak while forwards pile up, the inputs
    ``I`` keeps for ``W`` later, the fused last stage's transient at its ``F`` steps."""
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4, body="zb"))
    held = bytes_by_step(
        plan, 1, ItemSizes(activations={}, stage_inputs={1: 5, 3: 5}, output_gradients={1: 300, 3: 300})
    )
    calibration = _calibrated({1: 200}, {1: {"I": 40, "W": 10}, 3: {"fused": 500, "W": 20}})
    stats = tape_stats(calibration, plan, 1, recompute=False, held_by_step=held)
    tapes = bytes_by_step(plan, 1, ItemSizes(activations={1: 200}, stage_inputs={}))
    transients = [calibration.transient_of(step) for step in backward_steps(plan, 1)]
    by_step = [1000 + h + t + b for h, t, b in zip(held, tapes, transients, strict=True)]
    assert stats["predicted_peak"] == max(by_step)
    assert sum(stats["predicted_parts"].values()) == stats["predicted_peak"]
    summed_peaks = 1000 + max(held) + max(tapes) + 500
    assert stats["predicted_peak"] < summed_peaks  # what the sum of peaks over-predicted
    assert stats["tape_peak"] == max(tapes) == 800  # four stage-1 forwards, each held until its W
    assert stats["backward_transient_bytes"] == {1: 40, 3: 500}


def test_a_whole_backward_adds_its_transient_where_the_tapes_peak() -> None:
    """Plain 1F1B rank 0 at P = 2: the first ``B`` runs while both forwards' tapes are held."""
    plan = build_plan(PlanConfig(pp=2, micro=4, body="1f1b"))
    held = [10] * len(plan.order_codes[0])
    stats = tape_stats(_calibrated({0: 200}, {0: {"B": 30}}), plan, 0, recompute=False, held_by_step=held)
    assert stats["predicted_parts"] == {
        "base_in_use": 1000,
        "held": 10,
        "tape": 400,
        "backward_transient": 30,
    }
    rc = tape_stats(_calibrated({}, {0: {"B": 230}}), plan, 0, recompute=True, held_by_step=held)
    assert rc["predicted_peak"] == 1000 + 10 + 230 and rc["tape_peak"] == 0


def test_held_counts_must_cover_the_plan() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=4, body="1f1b"))
    with pytest.raises(ValueError, match="3 held counts for a plan of"):
        tape_stats(_calibrated({0: 1}, {0: {"B": 1}}), plan, 0, recompute=False, held_by_step=[1, 2, 3])
    assert tape_stats(None, plan, 0, recompute=False, held_by_step=[])["predicted_peak"] is None
