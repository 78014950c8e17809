"""``graph-exec bench qwen2vl --tower-ratio``: its arguments and its arithmetic, without launching.

The launch and the start-up calibration are replaced by tripwires; the report code is checked on
costs where the right answers are known.
"""

from __future__ import annotations

import json

import pytest

from graph_exec.cli import jobs, main, tower_sweep
from graph_exec.report import tower_sweep as sweep
from graph_exec.report.job import JobSpec, RunSpec
from graph_exec.simulate import OpCosts


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)
    monkeypatch.setattr(tower_sweep, "calibrate", tripwire)


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "vl_tower", "--tower-ratio", "2"],
            "scales the vision tower of 'qwen2vl', not of 'vl_tower'",
        ),
        (["bench", "qwen2vl", "--tower-ratio", "0,2"], "tower ratios must be numbers > 0"),
        (["bench", "qwen2vl", "--tower-ratio", "two"], "tower ratios must be numbers > 0"),
        (
            ["bench", "qwen2vl", "--tower-ratio", "2", "--variants", "trainable-full"],
            "may only name frozen-full",
        ),
        (
            ["bench", "qwen2vl", "--tower-ratio", "2", "--dp", "2", "--ranks", "4"],
            "--dp and --nodes must be 1",
        ),
        (["bench", "qwen2vl", "--plot", "x.png"], "--plot draws the --tower-ratio sweep"),
        (["bench", "qwen2vl", "--tower-ratio", "2", "--ranks", "1"], "--ranks must be at least 2, got 1"),
    ],
)
def test_bad_arguments_exit_2_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in _exit(argv, capsys)


def test_runs_are_the_two_baselines_and_the_mpipe_variants():
    runs = tower_sweep.runs(("frozen-full", "frozen-min"), ("graph",), (1, 2, 2, 3))
    assert [r.name for r in runs] == [
        "baseline-frozen.graph",
        "baseline-rebalanced.graph",
        "frozen-full.graph",
        "frozen-min.graph",
    ]
    assert runs[0].layers is None and runs[1].layers == (1, 2, 2, 3) and runs[1].baseline
    assert (runs[2].run_ahead, runs[3].run_ahead) == ("full", "min") and not runs[2].trainable


def test_the_job_file_keeps_the_rebalanced_split_and_the_model_options(tmp_path):
    runs = (RunSpec("baseline-rebalanced.graph", baseline=True, layers=(1, 2, 2, 3)),)
    job = JobSpec("qwen2vl", "tiny", 2, 2, 4, 8, 1, 1, runs, model_options={"vision_depth": 5})
    again = JobSpec.read(job.write(tmp_path))
    assert again == job and again.runs[0].layers == (1, 2, 2, 3)


def test_depth_follows_the_ratio():
    costs = sweep.StartupCosts(
        chunk_forward=10.0, layer_step=6.0, tower_fixed=2.0, tower_block=1.0, layers_per_chunk=2
    )
    assert [costs.depth_for(r) for r in (0.05, 0.5, 1, 2, 4)] == [1, 3, 8, 18, 38]
    assert costs.tower(18) == 20.0


def test_a_depth_off_the_scale_is_refused_naming_the_costs():
    """A near-zero block cost (a noisy calibration) once asked for 1008 blocks and crashed the ranks."""
    costs = sweep.StartupCosts(
        chunk_forward=0.003, layer_step=0.006, tower_fixed=0.001, tower_block=1e-6, layers_per_chunk=1
    )
    assert costs.depth_for(1e-4) == 1
    with pytest.raises(ValueError, match=r"--tower-ratio 2 needs \d+ vision blocks .* at most 64"):
        costs.depth_for(2)


def known_costs(layers, fwd=1.0, bwd=2.0, first=0.5, last=0.75) -> OpCosts:
    """Measured-style costs of a split with per-layer ``fwd``/``bwd`` and stage extras."""
    forward = [n * fwd for n in layers]
    backward = [n * bwd for n in layers]
    forward[0] += first
    forward[-1] = layers[-1] * (fwd + bwd) + last
    backward[-1] = 0.01
    return OpCosts(forward=fwd, backward=bwd, stage_forward=tuple(forward), stage_backward=tuple(backward))


def test_layer_costs_recover_the_per_layer_costs_and_the_extras():
    c = sweep.layer_costs(known_costs((2, 2, 2, 2)), (2, 2, 2, 2))
    assert (c.forward, c.backward, c.first_forward, c.first_backward) == pytest.approx((1.0, 2.0, 0.5, 0.0))
    assert (c.last_extra, c.last_backward) == pytest.approx((0.75, 0.01))
    forward, backward = sweep.stage_costs(c, (1, 2, 2, 3))
    assert forward == pytest.approx((1.5, 2.0, 2.0, 9.75)) and backward == pytest.approx(
        (2.0, 4.0, 4.0, 0.01)
    )


def test_simulation_ranks_the_schedules_as_the_tower_grows():
    layers = (4, 4)  # V = 1: plain 1F1B, where the uneven first stage pays
    base = sweep.layer_costs(known_costs(layers), layers)
    none = {name: OpCosts() for name in sweep.MPIPE}
    light = sweep.simulated(base, none, 0.0, 2, 1, 8, 8)
    assert light["baseline-frozen"] == pytest.approx(light["baseline-rebalanced"])
    tower = 12.0
    mpipe = {name: OpCosts(preprocess_forward=tower) for name in sweep.MPIPE}
    heavy = sweep.simulated(base, mpipe, tower, 2, 1, 8, 8)
    assert heavy["baseline-rebalanced"] < heavy["baseline-frozen"]
    assert heavy["frozen-full"] < heavy["baseline-rebalanced"]
    wide = sweep.simulated(base, mpipe, tower, 8, 2, 16, 32)
    assert set(wide) == set(sweep.SCHEDULES) and all(v > 0 for v in wide.values())


def test_table_and_document_show_every_point():
    costs = sweep.StartupCosts(0.01, 0.006, 0.002, 0.001, 2)
    point = sweep.SweepPoint(
        ratio=2.0,
        depth=18,
        tower_s=0.02,
        rebalanced=(1, 2, 2, 3),
        measured={name: (0.09, 0.1, 0.11) for name in sweep.SCHEDULES} | {"frozen-full": (0.07, 0.08, 0.09)},
        simulated={p: {name: 0.1 for name in sweep.SCHEDULES} for p in sweep.SIMULATED_RANKS},
        pf_measured=0.021,
    )
    text = sweep.table([point], costs, 2)
    assert "1.25" in text and "[1, 2, 2, 3]" in text and "simulated" in text
    doc = json.loads(json.dumps(sweep.document([point], costs, 2, 2, 4)))
    assert doc["points"][0]["measured_s"]["frozen-full"]["p50"] == 0.08
    assert set(doc["points"][0]["simulated_s"]) == {"2", "4", "8"}
