"""``graph_exec.tune`` and ``graph-exec tune``: candidates, predictions checked by hand, the
budget, and bad cost files."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from graph_exec.cli import main
from graph_exec.tune import Candidate, CostFileError, ModelCosts, NoPlanFitsError, predict, tune

MIB = 2**20
COSTS = ModelCosts(
    layers=8,
    micro_batch_size=1,
    layer_forward=1.0,
    layer_backward=2.0,
    layer_activation_bytes=4 * MIB,
    layer_param_bytes=16 * MIB,
    hidden_bytes=1 * MIB,
    preprocess="frozen",
    preprocess_forward=4.0,
    preprocess_output_bytes=1 * MIB,
    preprocess_param_bytes=64 * MIB,
)


def test_a_plain_pipeline_is_predicted_as_counted_by_hand() -> None:
    """No preprocess, P = 2, V = 1, M = 4, one row per micro-batch: interleaved at V = 1 holds
    2(P-1-r)+1 micro-batches on rank r (3 and 1); rank 0 holds 4 layers' parameters, their
    gradients and Adam's two moments (4 × 16 MiB × 4); at its peak, before its first backward,
    3 tapes of 4 layers (3 × 16 MiB) and the one gradient received for that backward (1 MiB)."""
    costs = replace(COSTS, preprocess="none", preprocess_forward=0.0, preprocess_param_bytes=0)
    got = predict(costs, 2, 4, Candidate("baseline", "even", 1, 4))
    assert got.layers == (4, 4)
    assert got.peak_bytes[0] == 4 * 16 * MIB * 4 + 3 * 16 * MIB + 1 * MIB
    assert got.step_time >= 4 * 4 * 3  # at least rank 0's own work: M × 4 layers × (F + B)


def test_recompute_holds_inputs_and_costs_a_forward() -> None:
    """Recompute keeps 3 stage inputs (1 MiB) instead of 3 tapes of 4 layers (16 MiB), and
    during a backward the one tape it rebuilds (4 layers, 16 MiB)."""
    costs = replace(COSTS, preprocess="none", preprocess_forward=0.0, preprocess_param_bytes=0)
    taped = predict(costs, 2, 4, Candidate("baseline", "even", 1, 4))
    again = predict(costs, 2, 4, Candidate("baseline", "even", 1, 4, recompute=True))
    assert again.peak_bytes[0] == taped.peak_bytes[0] - 3 * 16 * MIB + 3 * 1 * MIB + 16 * MIB
    assert again.parts[0]["recomputed tape"] == 16 * MIB
    assert again.step_time > taped.step_time


def test_a_stage_calls_fixed_part_prices_fewer_longer_stages_cheaper() -> None:
    """8 layers, P = 2: the middle stages pay their call (0.5 forward, 0.75 backward) beside
    their layers, stage 0 and the fused last stage their own fixed parts; a recompute reruns
    the layers' forward inside the backward's call, not the call. With the call as dear as a
    layer, V = 1 (2 stages of 4) costs less than V = 2 (4 stages of 2)."""
    costs = replace(COSTS, chunk_forward=0.5, chunk_backward=0.75, first_stage_forward=0.25)
    got = predict(costs, 2, 2, Candidate("baseline", "even", 2, 2))
    assert got.op_costs.stage_forward == pytest.approx((2.25, 2.5, 2.5, 2.0))
    assert got.op_costs.stage_backward == pytest.approx((4.0, 4.75, 4.75, 4.0))
    again = predict(costs, 2, 2, Candidate("baseline", "even", 2, 2, recompute=True))
    assert again.op_costs.stage_backward == pytest.approx((6.25, 6.75, 6.75, 6.0))  # + stage 0 extra
    free = replace(COSTS, preprocess="none", preprocess_forward=0.0)
    dear = replace(free, chunk_forward=1.0, chunk_backward=2.0)
    one, two = (predict(dear, 2, 4, Candidate("baseline", "even", v, 4)).step_time for v in (1, 2))
    plain = [predict(free, 2, 4, Candidate("baseline", "even", v, 4)).step_time for v in (1, 2)]
    assert plain[1] < plain[0] and one < two  # interleaving wins only while calls are free


def test_a_heavy_frozen_tower_picks_mpipe_and_a_free_one_does_not() -> None:
    heavy = tune(COSTS, 2, 8)[0]
    assert heavy.candidate.schedule == "mpipe"
    free = tune(replace(COSTS, preprocess_forward=0.01, latency=0.5), 2, 8)[0]
    assert free.candidate.schedule == "baseline"


def test_every_returned_plan_fits_the_budget_and_a_tight_one_changes_the_choice() -> None:
    best = tune(COSTS, 2, 8)[0]
    budget = best.max_peak - 1
    fitting = tune(COSTS, 2, 8, memory_budget=budget)
    assert fitting and all(p.max_peak <= budget for p in fitting)
    assert fitting[0].candidate != best.candidate
    assert [p.step_time for p in fitting] == sorted(p.step_time for p in fitting)


def test_a_budget_no_plan_fits_names_the_smallest_peak_and_its_plan() -> None:
    every = tune(COSTS, 2, 8)
    smallest = min(every, key=lambda p: p.max_peak)
    with pytest.raises(
        NoPlanFitsError, match=rf"smallest predicted peak is {smallest.max_peak} bytes"
    ) as err:
        tune(COSTS, 2, 8, memory_budget=1000)
    assert smallest.candidate.describe() in str(err.value)


def test_a_measured_recompute_replaces_forward_plus_backward() -> None:
    """MPipe with a trainable preprocess and owners' backward: every owner's recompute-backward
    sits on its critical path, so a cheaper measured recompute shortens the step, and a cost
    file without it (``None``) prices it as the preprocess's forward plus backward."""
    trainable = replace(COSTS, preprocess="trainable", preprocess_backward=3.0)
    plan = Candidate("mpipe", "even", 1, 8, backward="owner")
    summed = predict(trainable, 2, 8, plan).step_time
    assert predict(replace(trainable, preprocess_recompute=7.0), 2, 8, plan).step_time == summed
    assert predict(replace(trainable, preprocess_recompute=2.0), 2, 8, plan).step_time < summed
    assert ModelCosts.from_mapping(asdict(trainable)).preprocess_recompute is None


def test_measured_scales_are_interpolated_and_the_fixed_share_extrapolates() -> None:
    """Points at 1/4 and 1/2 of the calibrated rows (0.5 and 0.8 of its cost), with (1, 1)
    implied: between them a straight line, beyond them the fixed share's line (0.2 + 0.8 k)."""
    from graph_exec.tune import compute_scale

    costs = replace(COSTS, fixed_share=0.2, scale_points=((0.5, 0.8), (0.25, 0.5)))
    assert compute_scale(costs, 0.5) == pytest.approx(0.8)
    assert compute_scale(costs, 0.375) == pytest.approx(0.65)
    assert compute_scale(costs, 0.75) == pytest.approx(0.9)
    assert compute_scale(costs, 2.0) == pytest.approx(1.8)
    assert compute_scale(costs, 0.125) == pytest.approx(0.3)
    assert compute_scale(replace(COSTS, fixed_share=0.2), 0.5) == pytest.approx(0.6)  # no points
    entries = json.loads(json.dumps(asdict(costs)))  # a cost file holds lists
    assert ModelCosts.from_mapping(entries).scale_points == ((0.5, 0.8), (0.25, 0.5))


def test_the_compute_of_a_prediction_leaves_out_the_overhead_and_the_last_stage() -> None:
    """P = 2, V = 1, 4 layers a stage, one row as calibrated: stage 0's F + B is 4 × 3, the
    tower's forward 4; the per-step overhead (0.5) is the runtime's, not compute. Measured
    costs twice as slow on stage 0 give twice its compute."""
    got = predict(replace(COSTS, op_overhead=0.5), 2, 1, Candidate("mpipe", "even", 1, 1))
    assert got.compute_time() == pytest.approx(4 * 3 + 4)
    slow = replace(
        got.op_costs, stage_forward=(8.0, 99.0), stage_backward=(16.0, 99.0), preprocess_forward=4.0
    )
    assert got.compute_time(slow, 0.0) == pytest.approx(8 + 16 + 4)


def test_rebalanced_candidates_take_layers_off_rank_0() -> None:
    got = predict(COSTS, 2, 8, Candidate("baseline", "rebalanced", 1, 8))
    assert got.layers[0] < got.layers[1] and sum(got.layers) == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_forward": -1.0}, "'layer_forward' must be a finite number >= 0"),
        ({"layers": 0}, "'layers' must be a finite number >= 1"),
        ({"hidden_bytes": "many"}, "'hidden_bytes' must be a number"),
        ({"preprocess": "maybe"}, "preprocess must be 'frozen', 'trainable' or 'none'"),
        ({"preprocess_recompute": -0.5}, "'preprocess_recompute' must be a finite number >= 0"),
        ({"chunk_backward": -0.1}, "'chunk_backward' must be a finite number >= 0"),
        ({"scale_points": [[0.5, 0]]}, r"'scale_points' needs k > 0 and s > 0, got \[0.5, 0.0\]"),
        ({"scale_points": "fast"}, "'scale_points' must be pairs"),
        ({"speed": 3}, r"unknown cost entries \['speed'\]"),
    ],
)
def test_bad_cost_entries_are_named(change: dict, message: str) -> None:
    with pytest.raises(CostFileError, match=message):
        ModelCosts.from_mapping({**asdict(COSTS), **change})


def test_a_missing_entry_is_named() -> None:
    entries = asdict(COSTS)
    del entries["layer_backward"]
    with pytest.raises(CostFileError, match=r"lacks \['layer_backward'\]"):
        ModelCosts.from_mapping(entries)


def test_the_command_prints_the_best_plans_and_exits_2_when_none_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(asdict(COSTS)), encoding="utf-8")
    assert main(["tune", "--costs", str(costs), "--batch", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith(" 1. mpipe") and len(out.splitlines()) == 4
    assert main(["tune", "--costs", str(costs), "--batch", "8", "--memory-budget", "1MiB"]) == 2
    assert "no plan fits" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**asdict(COSTS), "layer_forward": -2}), encoding="utf-8")
    assert main(["tune", "--costs", str(bad), "--batch", "8"]) == 2
    assert "'layer_forward'" in capsys.readouterr().err
