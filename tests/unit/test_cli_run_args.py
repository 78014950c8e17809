"""``graph-exec run`` / ``bench`` without launching: bad arguments, and the measurement maths.

Bad arguments must exit with code 2 and a message naming the value before msrun starts (the
launcher is replaced by a tripwire). The analysis, prediction and report code is checked on
synthetic per-rank records, built from a simulated timeline where the right answers are known.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from graph_exec.cli import jobs, main
from graph_exec.harness.worker import cores_for
from graph_exec.report import analysis, bench_report, bench_schema
from graph_exec.report.job import PROGRESS, JobSpec, RunSpec
from graph_exec.report.predict import predict
from graph_exec.report.records import Event, RankRecord, StepRecord, read_run
from graph_exec.report.trace import chrome_trace, plot_timeline
from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.simulate import OpCosts, simulate


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in this module may start msrun."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "mnist"], "argument example: invalid choice: 'mnist' (choose from"),
        (
            ["run", "embed_lm", "--ranks", "0"],
            "argument --ranks: invalid value '0': must be a positive int",
        ),
        (
            ["run", "embed_lm", "--steps", "-1"],
            "argument --steps: invalid value '-1'",
        ),
        (["run", "embed_lm", "--steps", "-2"], "argument --steps: invalid value '-2'"),
        (["run", "embed_lm", "--micro", "4", "--batch", "6"], "--batch 6 is not a multiple of --micro 4"),
        (["run", "vl_tower", "--backward", "owner"], "backward 'owner' needs preprocess 'trainable'"),
        (["run", "embed_lm", "--ranks", "1", "--backward", "owner"], "backward 'owner' needs a peer rank"),
        (["run", "embed_lm", "--baseline", "--run-ahead", "min"], "--baseline runs without MPipe"),
        (["run", "embed_lm", "--baseline", "--overflow", "min"], "--baseline runs without MPipe"),  # old name
        (
            ["run", "embed_lm", "--data", "shuffled", "--seq-len-range", "8,16"],
            "--data shuffled reads a fixed set of samples of one length: it cannot take --seq-len-range",
        ),
        (["run", "embed_lm", "--data", "random"], "argument --data: invalid choice: 'random'"),
        (["run", "embed_lm", "--baseline", "--keep-preprocess-tape"], "--keep-preprocess-tape do not apply"),
        (
            ["run", "vl_tower", "--keep-preprocess-tape"],
            "--keep-preprocess-tape needs a trainable preprocess",
        ),
        (["run", "embed_lm", "--frozen", "--trainable"], "not allowed with argument --frozen"),
        (
            ["run", "embed_lm", "--zero", "1"],
            "--zero 1 shards the optimizer state over the data-parallel replicas, but --dp is 1",
        ),
        (["run", "embed_lm", "--zero", "2"], "argument --zero: invalid choice: 2 (choose from 0, 1)"),
        (["run", "embed_lm", "--timeout", "0"], "argument --timeout: invalid value '0'"),
        (
            ["run", "embed_lm", "--micro", "100000000", "--batch", "100000000"],
            "micro=100000000: every rank's plan would take about",
        ),
        (["bench", "mnist"], "argument example: invalid choice: 'mnist'"),
        (["bench", "--ranks", "0"], "argument --ranks: invalid value '0'"),
        (["bench", "--steps", "0"], "argument --steps: invalid value '0'"),
        (["bench", "--warmup", "0"], "argument --warmup: invalid value '0'"),
        (
            ["bench", "--variants", "frozen-full,turbo"],
            "unknown variant 'turbo'; choose from: frozen-full,frozen-min,trainable-full",
        ),
        (["bench", "--variants", ","], "unknown variant ','"),
        (["bench", "--modes", "graph,eager"], "unknown mode 'eager'; choose from: graph,pynative"),
        (
            ["bench", "--ranks", "1", "--variants", "trainable-full-owner"],
            "run trainable-full-owner.graph: backward 'owner' needs a peer rank",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _exit(argv, capsys)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("flag", ["--json", "--trace", "--plot"])
def test_unwritable_output_paths_exit_2(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["bench"] if flag == "--json" else ["run", "embed_lm"]
    missing = tmp_path / "no" / "such" / "out.json"
    code, err = _exit([*command, flag, str(missing)], capsys)
    assert code == 2
    assert f"directory {str(missing.parent)!r} does not exist" in err
    code, err = _exit([*command, flag, str(tmp_path)], capsys)
    assert code == 2
    assert "is a directory, expected a file path" in err


def test_log_dir_under_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = _exit(["run", "embed_lm", "--log-dir", str(blocker / "logs")], capsys)
    assert code == 2
    assert "is a file" in err


def test_plot_without_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import graph_exec.cli.run as run_cli

    real = run_cli.importlib.util.find_spec
    monkeypatch.setattr(
        run_cli.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    code, err = _exit(["run", "embed_lm", "--plot", str(tmp_path / "t.png")], capsys)
    assert code == 2
    assert "pip install -e '.[plot]'" in err


def test_plot_timeline_import_error_carries_the_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plot\]'"):
        plot_timeline(_records(*_simulated()), 0, tmp_path / "t.png", "x")


def test_run_job_spec_defaults() -> None:
    """``graph-exec run embed_lm``: 2 ranks, V=2, M=4, batch 8, 1 warm-up + 7 measured steps."""
    from graph_exec.cli.run import job_from_args

    parser = main.__globals__["build_parser"]("run")
    args = parser.parse_args(["run", "embed_lm"])
    job = job_from_args(args, parser)
    assert (job.ranks, job.vpp, job.micro, job.batch, job.warmup, job.steps) == (2, 2, 4, 8, 1, 7)
    assert job.runs == (RunSpec("run", "graph", baseline=False, trainable=True),)
    assert job.pin_cores
    args = parser.parse_args(
        ["run", "vl_tower", "--trainable", "--backward", "owner", "--keep-preprocess-tape"]
    )
    (spec,) = job_from_args(args, parser).runs
    assert (spec.backward, spec.keep_preprocess_tape) == ("owner", True)


def test_run_body_reaches_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """``--body zb`` is the run's body and its plan's (split backward); a bad body exits 2."""
    from graph_exec.cli.run import job_from_args

    parser = main.__globals__["build_parser"]("run")
    job = job_from_args(parser.parse_args(["run", "embed_lm", "--body", "zb"]), parser)
    (spec,) = job.runs
    assert spec.body == "zb" and job.plan_config(spec).split_backward
    (default,) = job_from_args(parser.parse_args(["run", "embed_lm"]), parser).runs
    assert default.body == "interleaved"
    code, err = _exit(["run", "embed_lm", "--body", "zz"], capsys)
    assert code == 2 and "invalid choice: 'zz'" in err


def test_run_zero_reaches_the_schedule_option() -> None:
    """``--zero 1`` (with ``--dp 2``) is the run's ``optimizer_sharding``; off by default."""
    from graph_exec.cli.run import job_from_args

    parser = main.__globals__["build_parser"]("run")
    args = parser.parse_args(["run", "embed_lm", "--ranks", "4", "--dp", "2", "--zero", "1"])
    (spec,) = job_from_args(args, parser).runs
    assert spec.optimizer_sharding
    (default,) = job_from_args(parser.parse_args(["run", "embed_lm"]), parser).runs
    assert not default.optimizer_sharding


def test_bench_adds_the_baselines_each_variant_needs() -> None:
    runs = bench_report.runs_for(["frozen-min", "trainable-full-owner"], ["graph", "pynative"])
    names = [r.name for r in runs]
    assert names == [
        "baseline-frozen.graph",
        "baseline-trainable.graph",
        "frozen-min.graph",
        "trainable-full-owner.graph",
        "baseline-frozen.pynative",
        "baseline-trainable.pynative",
        "frozen-min.pynative",
        "trainable-full-owner.pynative",
    ]
    assert runs[3].backward == "owner" and runs[3].trainable and runs[1].baseline


def test_job_spec_round_trip(tmp_path: Path) -> None:
    job = JobSpec(
        "vl_tower", "tiny", 2, 2, 4, 8, 3, 1, runs=bench_report.runs_for(["frozen-full"], ["graph"])
    )
    job.write(tmp_path)
    assert JobSpec.read(tmp_path / "job.json") == job


def test_a_job_file_written_before_the_rename_reads_overflow_as_run_ahead(tmp_path: Path) -> None:
    job = JobSpec("vl_tower", "tiny", 2, 2, 4, 8, 3, 1, runs=bench_report.runs_for(["frozen-min"], ["graph"]))
    data = json.loads(job.write(tmp_path).read_text(encoding="utf-8"))
    for run in data["runs"]:
        run["overflow"] = run.pop("run_ahead")  # how job.json named it before
    (tmp_path / "job.json").write_text(json.dumps(data), encoding="utf-8")
    again = JobSpec.read(tmp_path / "job.json")
    assert again == job and [r.run_ahead for r in again.runs] == ["full", "min"]


def test_cores_are_shared_out_evenly() -> None:
    assert cores_for(0, 2, [0, 1]) == {0}
    assert cores_for(1, 2, [0, 1]) == {1}
    assert cores_for(3, 4, [0, 1]) == {1}  # more ranks than cores: round robin
    assert cores_for(1, 2, list(range(8))) == {4, 5, 6, 7}


def test_log_tail_returns_only_complete_new_lines(tmp_path: Path) -> None:
    log = tmp_path / "worker_1.log"
    tail = jobs._LogTail(log)
    assert tail.lines() == []  # not created yet
    log.write_text(f"noise\n{PROGRESS}" + '{"step": 0')
    assert tail.lines() == ["noise"]
    with log.open("a") as out:
        out.write("}\nmore\n")
    assert tail.lines() == [PROGRESS + '{"step": 0}', "more"]
    seen: list[dict] = []
    jobs._echo([PROGRESS + '{"step": 0}', "other"], seen.append)
    assert seen == [{"step": 0}]


# -- measurement maths on records built from a simulation ------------------------------------------

COSTS = OpCosts(forward=0.010, backward=0.020, preprocess_forward=0.008, fused_last_stage=True)


def _simulated(preprocess: str = "frozen") -> tuple:
    config = PlanConfig(pp=2, vpp=2, micro=4, preprocess=preprocess)
    plan = build_plan(config)
    return plan, simulate(plan, COSTS)


def _records(plan, result, steps: int = 3, gap: float = 0.001) -> list[RankRecord]:
    """Every rank runs the simulated timeline ``steps`` times, ``gap`` of overhead at each end."""
    records = []
    for rank in range(plan.config.pp):
        rows = [e for e in result.timeline if e.rank == rank]
        out = []
        for k in range(steps):
            origin = k * 10.0
            events = tuple(Event(e.token, origin + gap + e.start, origin + gap + e.end) for e in rows)
            end = events[-1].end + gap  # run() returns once the rank's last step is done
            out.append(StepRecord(k, origin, end, events, 1.0 - k * 0.1, 5, 0.5, 4))
        records.append(RankRecord("x", rank, plan.config.pp, tuple(out), 4096, 4096, 0.0002))
    return records


def test_step_time_bubble_and_overhead_follow_their_definitions() -> None:
    plan, result = _simulated()
    records = _records(plan, result)
    views = analysis.step_views(records, warmup=1, last_stage=plan.last_stage)
    assert len(views) == 2
    view = views[0]
    assert view.seconds == pytest.approx(result.step_time + 0.002)
    compute = [
        sum(e.seconds for e in r.steps[1].events if analysis.kind_of(e.token) in analysis.COMPUTE_KINDS)
        for r in records
    ]
    assert view.compute == pytest.approx(compute)
    assert view.bubble == pytest.approx(1 - sum(compute) / (2 * view.seconds))
    # sends take no time in the simulation: overhead = the 2 ms outside the steps + hooks x dispatch
    hooks = [sum(analysis.calls_hook(e.token, plan.last_stage) for e in r.steps[1].events) for r in records]
    assert view.overhead == pytest.approx([0.002 + n * 0.0002 for n in hooks])
    # rank 0: 8 F, 8 B, 2 TFWD; rank 1: 8 F, 2 TFWD and the 4 B of stage 1 (the 4 B of the
    # last stage only pass on the gradient its fused F computed)
    assert hooks == [18, 14]
    summary = analysis.summarize(records, warmup=1, last_stage=plan.last_stage)
    assert summary.allocations_after_warmup == 0
    assert summary.compilations == 10 and summary.losses == pytest.approx((1.0, 0.9, 0.8))


def test_prediction_recovers_the_simulated_costs_and_step_time() -> None:
    plan, result = _simulated()
    records = _records(plan, result, gap=0.0)
    prediction = predict(plan, records, warmup=1)
    assert prediction.costs.forward == pytest.approx(COSTS.forward)
    assert prediction.costs.backward == pytest.approx(COSTS.backward)
    assert prediction.costs.preprocess_forward == pytest.approx(COSTS.preprocess_forward)
    assert prediction.costs.latency == pytest.approx(0.0) and math.isinf(prediction.costs.bandwidth)
    assert prediction.step_time == pytest.approx(result.step_time)
    assert prediction.error(result.step_time) == pytest.approx(0.0, abs=1e-9)


def test_chrome_trace_has_one_track_per_rank(tmp_path: Path) -> None:
    plan, result = _simulated()
    records = _records(plan, result, steps=2)
    doc = chrome_trace(records, "test")
    tracks = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(s.events) + 1 for r in records for s in r.steps)
    assert min(e["ts"] for e in spans) == 0.0
    assert {e["cat"] for e in spans} >= {"compute", "preprocess", "mpipe", "step"}
    json.dumps(doc)  # serialisable


def _bench_dir(tmp_path: Path, variant: str = "frozen-full") -> tuple[JobSpec, list[str]]:
    """A bench job whose per-rank records come from simulations of the runs' own plans."""
    job = JobSpec(
        "vl_tower",
        "tiny",
        2,
        2,
        4,
        8,
        2,
        1,
        runs=bench_report.runs_for([variant], ["graph", "pynative"]),
    )
    for spec in job.runs:
        plan = build_plan(job.plan_config(spec))
        slow = 1.0 if spec.mode == "graph" else 2.5
        costs = OpCosts(
            forward=0.010 * slow,
            backward=0.020 * slow,
            preprocess_forward=0.008 * slow,  # the fair baseline runs the same preprocess
            recompute=0.012 * slow,  # an MPipe TBWD: recompute and backward
            preprocess_backward=0.004 * slow,  # a fair baseline TBWD: the backward from the tape
            broadcast=0.001 * slow,
            fused_last_stage=True,
        )
        for record in _records(plan, simulate(plan, costs), gap=0.0):
            RankRecord(spec.name, record.rank, 2, record.steps, 4096, 4096, 0.0001).write(tmp_path)
    return job, [variant]


def test_bench_document_matches_its_schema(tmp_path: Path) -> None:
    job, variants = _bench_dir(tmp_path)
    doc = bench_report.document(job, variants, ["graph", "pynative"], bench_report.evaluate(job, tmp_path))
    assert bench_schema.check(doc) == []
    assert bench_schema.check(json.loads(json.dumps(doc))) == []
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {
        "baseline-frozen.graph",
        "frozen-full.graph",
        "baseline-frozen.pynative",
        "frozen-full.pynative",
    }
    graph = runs["frozen-full.graph"]
    assert graph["baseline_run"] == "baseline-frozen.graph"
    assert graph["pynative_over_graph"] == pytest.approx(2.5)
    assert graph["ratio_to_baseline"] == pytest.approx(
        graph["step_time_s"] / runs["baseline-frozen.graph"]["step_time_s"]
    )
    assert graph["prediction"]["error"] == pytest.approx(0.0, abs=1e-9)
    mpipe = graph["mpipe"]
    assert mpipe["theory_saving_s"] == pytest.approx(0.008)  # (NT - 1) * Pf, NT = 2
    # The records are simulations of each run's plan under one cost model, so the simulator's
    # saving from the measured costs is exactly the measured one.
    measured = runs["baseline-frozen.graph"]["step_time_s"] - graph["step_time_s"]
    assert mpipe["saving_s"] == pytest.approx(measured) and measured > 0
    assert mpipe["simulated_saving_s"] == pytest.approx(measured)
    assert mpipe["saving_over_simulated"] == pytest.approx(1.0)
    assert mpipe["saving_share"] == pytest.approx(measured / 0.008)
    assert runs["baseline-frozen.graph"]["mpipe"] is None
    assert runs["baseline-frozen.graph"]["preprocess"] == "frozen"
    text = bench_report.table(doc)
    assert "frozen-full.pynative" in text and "saving vs fair baseline (ms)" in text
    for column, _ in bench_report.SAVING_LEGEND:  # every column of the saving table has its legend
        assert f"  {column:>9s}: " in text


def test_trainable_saving_charges_each_run_its_own_preprocess_backward(tmp_path: Path) -> None:
    job, variants = _bench_dir(tmp_path, "trainable-full")
    doc = bench_report.document(job, variants, ["graph"], bench_report.evaluate(job, tmp_path))
    runs = {r["name"]: r for r in doc["runs"]}
    base, mpipe = runs["baseline-trainable.graph"], runs["trainable-full.graph"]
    assert base["prediction"]["costs"]["preprocess_backward_s"] == pytest.approx(0.004)
    assert base["prediction"]["costs"]["recompute_s"] == 0.0 and base["prediction"]["error"] == pytest.approx(
        0
    )
    assert mpipe["prediction"]["costs"]["recompute_s"] == pytest.approx(0.012)
    measured = base["step_time_s"] - mpipe["step_time_s"]
    assert mpipe["mpipe"]["saving_s"] == pytest.approx(measured)
    assert mpipe["mpipe"]["simulated_saving_s"] == pytest.approx(measured)


def test_schema_check_names_what_is_wrong(tmp_path: Path) -> None:
    job, variants = _bench_dir(tmp_path)
    doc = bench_report.document(job, variants, ["graph"], bench_report.evaluate(job, tmp_path))
    del doc["runs"][0]["bubble_fraction"]
    doc["runs"][1]["compilations"] = "many"
    doc["runs"][2]["mpipe"] = {"nt": 2}
    doc["version"] = True
    doc["extra"] = 1
    problems = bench_schema.check(doc)
    assert "$.runs[0]: missing 'bubble_fraction'" in problems
    assert "$.runs[1].compilations: expected int, got str" in problems
    assert "$.runs[2].mpipe: missing 'pf_s'" in problems
    assert "$.version: expected int, got bool" in problems
    assert "$: unexpected 'extra'" in problems


def test_schema_check_reads_version_2_documents_with_the_old_key_overflow(tmp_path: Path) -> None:
    job, variants = _bench_dir(tmp_path)
    doc = bench_report.document(job, variants, ["graph"], bench_report.evaluate(job, tmp_path))
    assert doc["version"] == 3 and {r["run_ahead"] for r in doc["runs"]} == {"full"}
    old = json.loads(json.dumps(doc))
    old["version"] = 2
    for run in old["runs"]:
        run["overflow"] = run.pop("run_ahead")
    assert bench_schema.check(old) == []
    old["version"] = 3  # version 3 names it run_ahead
    assert "$.runs[0]: missing 'run_ahead'" in bench_schema.check(old)
    assert "$.runs[0]: unexpected 'overflow'" in bench_schema.check(old)
    doc["version"] = 1
    assert bench_schema.check(doc) == [
        "$: expected schema 'graph-exec-bench' version 3 (or 2), got 'graph-exec-bench' 1"
    ]


def test_missing_rank_record_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"rank 0 wrote no record for run 'x'"):
        read_run(tmp_path, "x", 2)


def test_sync_steps_changes_timing_not_results() -> None:
    """The runtime's ``sync_steps`` (every run/bench step uses it) leaves losses and gradients
    alone (graph mode: where kernel calls return before their results exist)."""
    import numpy as np

    import graph_exec as ge
    from graph_exec.examples import load
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    out = []
    for sync in (False, True):
        model = load("embed_lm").build(2, size="tiny")
        stages = [ge.PipelineStage(model.stages[s], s, 2) for s in range(2)]
        sched = ge.ScheduleMPipeTranspose(
            stages, 2, model.preprocess, 2, mode="graph", loss_fn=model.loss_fn, sync_steps=sync
        )
        inputs, labels = model.batch(0, 4)
        losses = [float(x.asnumpy()) for x in sched.run(*inputs, labels=labels)]
        out.append((losses, {k: v.asnumpy().copy() for k, v in sched.grads().items()}))
        assert [e.step for e in sched.timeline] == [s.token for s in sched.plan.orders[0]]
    (plain_losses, plain_grads), (sync_losses, sync_grads) = out
    assert sync_losses == plain_losses
    assert plain_grads.keys() == sync_grads.keys()
    assert all(np.array_equal(plain_grads[k], sync_grads[k]) for k in plain_grads)


def test_every_default_is_shown_in_help() -> None:
    """Each option of each sub-command that has a default says it in ``--help``."""
    import argparse

    from graph_exec.cli import COMMANDS, build_parser

    silent = []
    for name in COMMANDS:
        sub = next(
            action for action in build_parser(name)._actions if isinstance(action, argparse._SubParsersAction)
        ).choices[name]
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
                continue
            text = formatter._expand_help(action)
            if "default" not in text.lower():
                silent.append(f"{name} {action.option_strings[-1]}")
            elif "%(default)s" not in (action.help or "") and "(default: " in text:
                assert str(action.default) in text, (name, action.option_strings, text)
    assert silent == []
