"""``graph-exec tune EXAMPLE``'s pieces without a launch: its bad input, the cost model's fixed
share and per-step overhead checked by hand, the verify table (and ``tune_sweep`` reading it),
the runs it launches, and ``calibrate`` on a user's own three-stage model (one process,
MindSpore)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from graph_exec.benchmarks.tune_sweep import command, parse
from graph_exec.cli import main
from graph_exec.cli.tune_example import VERIFIED, run_spec, to_verify, verify_table
from graph_exec.tune import Candidate, CostFileError, ModelCosts, predict, tune

PLAIN = ModelCosts(
    layers=4,
    micro_batch_size=2,
    layer_forward=1.0,
    layer_backward=2.0,
    layer_activation_bytes=100,
    layer_param_bytes=10,
    hidden_bytes=8,
)
#: A heavy frozen tower over 8 layers: MPipe, the fair and the rebalanced baseline all apply.
FROZEN = replace(PLAIN, preprocess="frozen", preprocess_forward=6.0, layers=8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune", "nosuch"], "unknown example 'nosuch'; choose one of: vl_tower, embed_lm, qwen2vl, llama"),
        (["tune", "vl_tower", "--tower-ratio", "2"], "--tower-ratio scales the vision tower of 'qwen2vl'"),
        (["tune"], "pass one of EXAMPLE"),
        (["tune", "vl_tower", "--latency", "0.001"], "--latency and --bandwidth go together"),
        (["tune", "vl_tower", "--ranks", "1"], "--ranks must be at least 2, got 1"),
    ],
)
def test_bad_input_exits_2_before_anything_runs(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_fixed_share_and_op_overhead_as_counted_by_hand() -> None:
    """One rank, V = 1: the step is M fused steps of the 4 layers (F + B each). M = 2 of a
    batch of 2 is half the calibrated rows: with a fixed share f each costs f + (1 - f) / 2 of
    the calibrated 4 x 3, plus the overhead once (the fused last stage's B costs nothing)."""
    base = predict(PLAIN, 1, 2, Candidate("baseline", "even", 1, 2))
    assert base.step_time == pytest.approx(2 * 4 * 3 * 0.5)
    costs = replace(PLAIN, fixed_share=0.4, op_overhead=0.25)
    got = predict(costs, 1, 2, Candidate("baseline", "even", 1, 2))
    assert got.step_time == pytest.approx(2 * (4 * 3 * (0.4 + 0.6 * 0.5) + 0.25))
    assert got.peak_bytes == base.peak_bytes  # sizes still scale with the rows alone


def test_a_fixed_share_outside_0_1_is_named() -> None:
    with pytest.raises(CostFileError, match="'fixed_share' must be in"):
        replace(PLAIN, fixed_share=1.5)
    with pytest.raises(CostFileError, match="'op_overhead' must be a finite number >= 0"):
        replace(PLAIN, op_overhead=-1.0)


def test_the_verify_table_names_the_fastest_and_judges_the_choice() -> None:
    best = [predict(PLAIN, 2, 4, Candidate("baseline", "even", v, 4)) for v in (1, 2)]
    out = verify_table(best, [best[0].step_time * 1.05, best[0].step_time])
    lines = out.strip().splitlines()
    assert lines[0] == "verified (ms):" and lines[1].startswith(" 1. ") and lines[2].startswith(" 2. ")
    assert "measured/predicted 1.050" in lines[1]
    assert lines[3] == f"fastest measured: #2 {best[1].candidate.describe()}"
    assert lines[4] == "chosen #1 is 1.050x the fastest verified: NOT within 1.03x"
    assert verify_table(best, [1.0, 1.02]).strip().endswith("within 1.03x")
    assert "NOT" not in verify_table(best, [1.0, 1.02])


def test_verify_adds_the_best_of_every_family_missing_from_the_top_three() -> None:
    """Whether MPipe was the right schedule is measured only if a baseline runs beside it: the
    top three, then the best fair and rebalanced baselines where they are not among them."""
    results = tune(FROZEN, 2, 8)
    checked = to_verify(results)
    assert checked[:VERIFIED] == results[:VERIFIED]
    families = [(p.candidate.schedule, p.candidate.split) for p in checked]
    assert set(families) == {(p.candidate.schedule, p.candidate.split) for p in results}
    for extra in checked[VERIFIED:]:
        same = [
            p
            for p in results
            if (p.candidate.schedule, p.candidate.split) == (extra.candidate.schedule, extra.candidate.split)
        ]
        assert extra is same[0]  # the family's fastest predicted


def test_the_mpipe_verdict_compares_with_the_fastest_baseline() -> None:
    mpipe = predict(FROZEN, 2, 8, Candidate("mpipe", "even", 1, 8))
    even = predict(FROZEN, 2, 8, Candidate("baseline", "even", 1, 8))
    rebalanced = predict(FROZEN, 2, 8, Candidate("baseline", "rebalanced", 1, 8))
    out = verify_table([mpipe, even, rebalanced], [1.0, 1.2, 1.1]).strip().splitlines()
    assert out[-1] == (
        "MPipe faster than the best baseline (baseline split=rebalanced: 1000.00 against 1100.00 ms);"
        " the search chose mpipe: agrees"
    )
    out = verify_table([mpipe, even, rebalanced], [1.0, 0.9, 1.1]).strip().splitlines()
    assert out[-1].startswith("MPipe not faster than the best baseline (baseline split=even")
    assert out[-1].endswith("the search chose mpipe: DISAGREES")
    assert "MPipe" not in verify_table([even, rebalanced], [1.0, 1.1])
    out = verify_table([mpipe, even, rebalanced], [1.0, 0.99, 1.1]).strip().splitlines()
    assert out[-1].endswith("the search chose mpipe: DISAGREES (a tie: 1.010x apart, within 1.03x)")
    assert parse(verify_table([mpipe, even, rebalanced], [1.0, 0.99, 1.1])).mpipe_tie
    assert not parse(verify_table([mpipe, even, rebalanced], [1.0, 0.9, 1.1])).mpipe_tie


def test_the_runs_verify_launches_carry_the_candidates_options() -> None:
    frozen = replace(PLAIN, preprocess="frozen", preprocess_forward=3.0)
    mpipe = predict(frozen, 2, 4, Candidate("mpipe", "even", 1, 4, run_ahead="min", recompute=True))
    spec = run_spec(1, mpipe, trainable=False)
    assert (spec.baseline, spec.run_ahead, spec.recompute, spec.layers) == (False, "min", True, None)
    rebalanced = predict(frozen, 2, 4, Candidate("baseline", "rebalanced", 1, 4))
    spec = run_spec(2, rebalanced, trainable=False)
    assert spec.baseline and spec.layers == rebalanced.layers and spec.layers != (2, 2)


def test_calibrate_measures_a_users_own_model() -> None:
    """Three Dense chunks of 2, 1 and 1 layers on 4 rows: the sizes are exact, the times
    positive and finite, and the result is a valid cost file that plans."""
    pytest.importorskip("mindspore")
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from graph_exec.harness.model_costs import calibrate
    from graph_exec.msenv import prepare_mindspore
    from graph_exec.tune import tune

    prepare_mindspore("CPU")
    ms.set_seed(0)
    width = 16

    def chunk(n: int) -> nn.Cell:
        return nn.SequentialCell([layer for _ in range(n) for layer in (nn.Dense(width, width), nn.Tanh())])

    stages = [chunk(2), chunk(1), chunk(1)]
    for k, stage in enumerate(stages):
        stage.update_parameters_name(f"stage{k}.")
    x = ms.Tensor(np.ones((4, width), np.float32))
    y = ms.Tensor(np.zeros((4, width), np.float32))
    costs = calibrate(stages, [2, 1, 1], (x,), (y,), nn.MSELoss(), repeats=3)
    assert costs.layers == 4 and costs.micro_batch_size == 4 and costs.preprocess == "none"
    assert costs.hidden_bytes == 4 * width * 4
    assert costs.layer_param_bytes == (width * width + width) * 4
    assert costs.layer_activation_bytes >= costs.hidden_bytes
    assert 0 < costs.layer_forward < math.inf and 0 <= costs.layer_backward < math.inf
    assert tune(costs, 2, 8)
    with pytest.raises(ValueError, match="at least 3 stages"):
        calibrate(stages[:2], [2, 1], (x,), (y,), nn.MSELoss(), repeats=1)


def test_launch_costs_give_layers_calls_extras_the_fixed_share_and_the_overhead() -> None:
    """Three launches, batch 8, P = 2. At M = 2 (4 rows), V = 2 (4 one-layer stages): a layer's F
    is 2 and B 4 on top of a call of 1 and 2 (the middle stages cost 3 and 6), stage 0 holds
    the layer and a fixed 2 and 1, the last stage's fused F is 9 and its send 0.5; V = 1 (two
    two-layer stages) tells the layer from the call: stage 0 costs 2 + 2 x 2 and 1 + 2 x 4, the
    last 2 x 6 + 3.5. At M = 8 (1 row, V = 2) every compute costs half: rows down 4x, cost down
    2x, so the fixed share f solves f + (1 - f) / 4 = 1/2: f = 1/3. Each launch measured more
    than its simulation: 3.0 s over 2 x (2 x 2 + 1) = 10 compute steps of rank 0, 0.8 s over 40,
    1.5 s over 2 x (2 x 1 + 1) = 6."""
    from graph_exec.cli.tune_example import Launch, from_launches
    from graph_exec.simulate import OpCosts

    def op(scale: float, forward=(4, 3, 3, 9), backward=(5, 6, 6, 0.5)) -> OpCosts:
        return OpCosts(
            stage_forward=tuple(scale * f for f in forward),
            stage_backward=tuple(scale * b for b in backward),
            preprocess_forward=scale * 6,
            latency=0.01,
            bandwidth=1e9,
        )

    v1 = op(1.0, (6, 15.5), (9, 0))
    launches = [
        Launch(2, op(1.0), 13.0, 10.0, 2, (1, 1, 1, 1)),
        Launch(8, op(0.5), 20.8, 20.0, 2, (1, 1, 1, 1)),
        Launch(2, v1, 9.5, 8.0, 1, (2, 2)),
    ]
    costs = replace(PLAIN, preprocess="frozen", preprocess_output_bytes=8)
    got = from_launches(costs, 8, launches)
    assert got.micro_batch_size == 4
    assert (got.layer_forward, got.layer_backward) == (pytest.approx(2.0), pytest.approx(4.0))
    assert (got.chunk_forward, got.chunk_backward) == (pytest.approx(1.0), pytest.approx(2.0))
    assert (got.first_stage_forward, got.first_stage_backward) == (pytest.approx(2.0), pytest.approx(1.0))
    assert got.last_stage_forward == pytest.approx(3.5)  # 9 + 0.5 - 6 and 15.5 - 12
    assert (got.preprocess_forward, got.latency, got.bandwidth) == (6.0, 0.01, 1e9)
    assert got.fixed_share == pytest.approx(1 / 3)
    assert got.scale_points == ((0.25, pytest.approx(0.5)),)  # 1/4 of the rows, half the compute
    assert got.op_overhead == pytest.approx((3.0 / 10 + 0.8 / 40 + 1.5 / 6) / 3)
    assert got.layer_param_bytes == PLAIN.layer_param_bytes  # sizes stay as calibrated
    assert got.preprocess_recompute is None  # a frozen preprocess is never recomputed
    # the plans priced with them cost what was measured (the runtime's own time aside)
    for vpp, ops in ((2, op(1.0)), (1, v1)):
        p = predict(replace(got, op_overhead=0.0), 2, 8, Candidate("baseline", "even", vpp, 2))
        assert p.op_costs.stage_forward[:-1] == pytest.approx(ops.stage_forward[:-1])
        assert p.op_costs.stage_backward[:-1] == pytest.approx(ops.stage_backward[:-1])
        fused = p.op_costs.stage_forward[-1] + p.op_costs.stage_backward[-1]
        assert fused == pytest.approx(ops.stage_forward[-1] + ops.stage_backward[-1])
    trainable = replace(costs, preprocess="trainable")
    launches = [Launch(2, replace(op(1.0), preprocess_backward=7.0), 13.0, 10.0, 2, (1, 1, 1, 1))]
    got = from_launches(trainable, 8, launches, recompute=9.5)
    assert (got.preprocess_backward, got.preprocess_recompute) == (7.0, 9.5)


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
    assert got.mpipe_tie  # 1.07 against 1.05: within 1.03x of each other
    assert parse(verify_table([even, replace(even)], [1.0, 1.0])).mpipe_verdict == "-"
    assert parse(verify_table([even, replace(even)], [1.0, 1.0])).compute is None
    with pytest.raises(ValueError, match="no verify table"):
        parse("tune failed")


def test_a_tower_ratio_case_passes_its_ratio() -> None:
    assert command("qwen2vl:0.5", 2)[-2:] == ["--tower-ratio", "0.5"]
    assert "--tower-ratio" not in command("embed_lm", 2)


def test_the_replay_reads_back_every_plan_tune_prints() -> None:
    from graph_exec.benchmarks.tune_replay import parse_candidate
    from graph_exec.tune import candidates

    trainable = replace(FROZEN, preprocess="trainable")
    every = candidates(trainable, 2, 8, splits=("even", "rebalanced"))
    assert len(every) > 20
    assert all(parse_candidate(c.describe()) == c for c in every)
    old = next(c for c in every if c.schedule == "mpipe" and c.run_ahead == "min")
    assert parse_candidate(old.describe().replace("run_ahead=", "overflow=")) == old  # logs before the rename
