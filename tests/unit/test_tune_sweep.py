"""``graph_exec.benchmarks.tune_sweep`` reads the verdicts of ``graph-exec tune --verify`` from
the very lines :func:`graph_exec.cli.tune_example.verify_table` prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from graph_exec.benchmarks.tune_sweep import command, parse
from graph_exec.cli.tune_example import verify_table
from graph_exec.tune import Candidate, ModelCosts, predict

FROZEN = ModelCosts(
    layers=8,
    micro_batch_size=2,
    layer_forward=1.0,
    layer_backward=2.0,
    layer_activation_bytes=100,
    layer_param_bytes=10,
    hidden_bytes=8,
    preprocess="frozen",
    preprocess_forward=6.0,
)


def test_the_sweep_reads_what_verify_prints() -> None:
    mpipe = predict(FROZEN, 2, 8, Candidate("mpipe", "even", 1, 8))
    even = predict(FROZEN, 2, 8, Candidate("baseline", "even", 1, 8))
    measured = [mpipe.step_time * 1.07, mpipe.step_time * 1.05]
    ops = [replace(even.op_costs, stage_forward=tuple(2 * f for f in even.op_costs.stage_forward))] * 2
    got = parse("calibrating\n" + verify_table([mpipe, even], measured, ops))
    assert got.compute is not None and got.compute > 1
    assert got.plan == mpipe.candidate.describe()
    assert got.predicted_ms == pytest.approx(mpipe.step_time * 1e3, abs=0.005)
    assert got.measured_over_predicted == pytest.approx(1.07, abs=1e-3)
    assert got.to_fastest == pytest.approx(1.07 / 1.05, abs=1e-3)
    assert got.mpipe_verdict == "DISAGREES"  # MPipe chosen, the baseline measured faster
    assert parse(verify_table([even, replace(even)], [1.0, 1.0])).mpipe_verdict == "-"
    assert parse(verify_table([even, replace(even)], [1.0, 1.0])).compute is None
    with pytest.raises(ValueError, match="no verify table"):
        parse("tune failed")


def test_a_tower_ratio_case_passes_its_ratio() -> None:
    assert command("qwen2vl:0.5", 2)[-2:] == ["--tower-ratio", "0.5"]
    assert "--tower-ratio" not in command("embed_lm", 2)
