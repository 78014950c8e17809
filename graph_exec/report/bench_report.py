"""``graph-exec bench`` results: variants, per-run evaluation, the printed table, the JSON file.

A bench job runs, on one workload, the fair baseline (``ScheduleInterleaved1F1B``: the same
preprocess run on rank 0 right before ``F 0.m``, nothing transposed) and the MPipe variants of
:data:`VARIANTS`, each in every requested mode. Every MPipe variant is compared with the fair
baseline of the same mode and the same preprocess trainability (added to the job
automatically), so the comparison isolates what transposition buys.

JSON document (``--json``), ``version`` 3 (checked by :mod:`graph_exec.report.bench_schema`, which
also accepts version 2, whose runs name ``run_ahead`` ``overflow``), every time in seconds,
every share a fraction::

    schema        "graph-exec-bench"
    version       3
    created       ISO-8601 UTC time
    environment   {python, mindspore, graph_exec: version strings; cpus: int}
    job           {example, size, ranks, dp (pipeline replicas; ranks / dp per pipeline), vpp,
                   micro (per replica), batch (over all replicas), steps, warmup, lr,
                   variants: [str], modes: [str]}
    definitions   {name: sentence}: how step time, bubble, overhead, prediction are measured
    runs          one object per (variant, mode):
      name, variant, mode            "frozen-full.graph", "frozen-full", "graph"
      baseline                       bool: the fair baseline (nothing transposed)
      preprocess, run_ahead, backward the schedule (a baseline has the preprocess of its variants)
      step_time_s, step_times_s      median, and every measured step
      baseline_run, ratio_to_baseline   the baseline's name and step_time / its step_time
                                     (null for a baseline)
      pynative_over_graph            pynative step time / graph step time of this variant
                                     (null unless both modes ran)
      bubble_fraction, overhead_fraction, dispatch_s
      compilations, compile_s        summed over ranks (whole run, warm-up included)
      allocations_after_warmup       receive-buffer allocations after warm-up, all ranks
      losses                         mean loss of every step (warm-up included)
      prediction                     {step_time_s, error (signed, relative), bubble_fraction,
                                      costs: {forward_s, backward_s, preprocess_forward_s,
                                      recompute_s, preprocess_backward_s (the
                                      fair baseline's TBWD), broadcast_s, allreduce_s, latency_s,
                                      bandwidth_bytes_per_s (null = infinite),
                                      activation_bytes, preprocess_bytes, fused_last_stage,
                                      stage_forward_s[], stage_backward_s[] (per stage)}}
      mpipe                          null for a baseline, else {nt, pf_s (median TFWD),
                                     saving_s = fair baseline step time - this step time
                                     (negative: MPipe is slower), simulated_saving_s (see
                                     :func:`simulated_saving`), saving_over_simulated =
                                     saving_s / simulated_saving_s (null unless the simulator
                                     predicts a saving > 0), theory_saving_s = (nt - 1) * pf_s,
                                     saving_share = saving_s / theory_saving_s}
"""

from __future__ import annotations

import datetime
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from graph_exec.report import analysis, predict
from graph_exec.report.analysis import RunSummary, summarize
from graph_exec.report.job import JobSpec, RunSpec
from graph_exec.report.predict import Prediction
from graph_exec.report.records import read_run
from graph_exec.schedule import Plan, StepKind, build_plan
from graph_exec.simulate import fair_baseline, simulate

SCHEMA = "graph-exec-bench"
VERSION = 3

#: MPipe variant name -> RunSpec fields. The baselines are added by :func:`runs_for`.
VARIANTS: dict[str, dict[str, Any]] = {
    "frozen-full": {"trainable": False, "run_ahead": "full"},
    "frozen-min": {"trainable": False, "run_ahead": "min"},
    "trainable-full": {"trainable": True, "run_ahead": "full"},
    "trainable-min": {"trainable": True, "run_ahead": "min"},
    "trainable-full-owner": {"trainable": True, "run_ahead": "full", "backward": "owner"},
    "trainable-min-owner": {"trainable": True, "run_ahead": "min", "backward": "owner"},
    # Opt-in: the owners keep the tape of their own TFWD instead of recomputing the preprocess.
    "trainable-full-owner-tape": {
        "trainable": True,
        "run_ahead": "full",
        "backward": "owner",
        "keep_preprocess_tape": True,
    },
    "trainable-full-tape": {"trainable": True, "run_ahead": "full", "keep_preprocess_tape": True},
}

DEFINITIONS = {
    "step_time": "first rank entering run() to last rank leaving it (steps start after a barrier); "
    "median over the measured steps",
    "bubble_fraction": "1 - (time in F, B, TFWD, TBWD, GRADrecv+bwd summed over ranks) / (ranks x step time)",
    "overhead_fraction": "runtime's own time on the worst rank / step time: run() wall time minus its "
    "plan steps, plus its send steps, plus its hook calls x the calibrated per-call dispatch cost",
    "prediction": "graph_exec.simulate on the run's plan with per-op costs measured in the same run "
    "(medians per stage; sends billed to the compute they follow)",
    "saving": "fair baseline's step time - this variant's (same mode and preprocess); negative: MPipe "
    "is slower",
    "simulated_saving": "the simulator's step time of the fair baseline minus this variant's, both from "
    "the costs measured in this variant's run (the baseline's own preprocess forward and backward)",
    "theory_saving": "(NT-1) x Pf: the schedule contract's estimate of the saving, (NT-1)(Pf-R) with R = 0",
}

#: The printed saving table's columns, each with the one-line legend printed under it.
SAVING_LEGEND = (
    ("measured", "fair baseline's median step time - this variant's (negative: MPipe is slower)"),
    ("simulated", "the same difference from the simulator, fed with the costs measured in this bench"),
    ("meas/sim", "measured / simulated: the share of the predicted saving the runtime delivers"),
    ("Pf", "median preprocess forward (TFWD) of this variant"),
    ("NT", "ranks that own micro-batches, min(P, M)"),
    ("(NT-1)Pf", "the schedule contract's estimate of the saving, (NT-1)(Pf-R) with R = 0 (section 1)"),
    ("share", "measured / (NT-1)Pf; negative when MPipe is slower than the fair baseline"),
)


def baseline_name(variant: str) -> str:
    return f"baseline-{'trainable' if VARIANTS[variant]['trainable'] else 'frozen'}"


def runs_for(variants: Sequence[str], modes: Sequence[str]) -> tuple[RunSpec, ...]:
    """Every run of a bench job: per mode, the baselines the variants need, then the variants."""
    runs = []
    for mode in modes:
        for trainable in sorted({VARIANTS[v]["trainable"] for v in variants}):
            name = f"baseline-{'trainable' if trainable else 'frozen'}"
            runs.append(RunSpec(name=f"{name}.{mode}", mode=mode, baseline=True, trainable=trainable))
        runs.extend(RunSpec(name=f"{v}.{mode}", mode=mode, **VARIANTS[v]) for v in variants)
    return tuple(runs)


@dataclass(frozen=True)
class RunResult:
    """One run, evaluated."""

    spec: RunSpec
    plan: Plan
    summary: RunSummary
    prediction: Prediction
    pf: float | None  #: median TFWD seconds (MPipe runs)
    nt: int

    @property
    def variant(self) -> str:
        return self.spec.name.rsplit(".", 1)[0]


def evaluate(job: JobSpec, run_dir: Path) -> list[RunResult]:
    """Read and evaluate every run of ``job`` from ``run_dir``."""
    last_stage = job.pp * job.vpp - 1
    results = []
    for spec in job.runs:
        records = read_run(run_dir, spec.name, job.ranks)
        plan = build_plan(job.plan_config(spec))
        results.append(
            RunResult(
                spec,
                plan,
                summarize(records, job.warmup, last_stage),
                # The simulator models one pipeline: replica 0's ranks (global ranks 0..pp-1).
                predict.predict(plan, records[: job.pp], job.warmup),
                analysis.median_seconds(records, job.warmup, StepKind.TFWD),
                plan.config.nt,
            )
        )
    return results


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def simulated_saving(variant: RunResult, baseline: RunResult) -> float:
    """The simulator's fair-baseline step time minus its step time for ``variant``.

    Both simulations take the costs measured in the variant's run (per-stage ``F``/``B``,
    transfers, ``BCAST``, recompute), except the two steps the fair baseline runs differently,
    which take the baseline run's measurements: its ``TFWD`` (no send follows it; trainable,
    it runs under the tape) and its ``TBWD`` (the backward from the tape, no recompute). Run
    noise in the body then cancels, and the difference is what the schedule itself predicts.
    """
    fair_costs = replace(
        variant.prediction.costs,
        preprocess_forward=baseline.prediction.costs.preprocess_forward,
        preprocess_backward=baseline.prediction.costs.preprocess_backward,
    )
    fair = simulate(fair_baseline(variant.plan), fair_costs).step_time
    return fair - variant.prediction.step_time


def _comparisons(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    by_name = {r.spec.name: r for r in results}
    out = {}
    for r in results:
        base = None if r.spec.baseline else by_name.get(f"{baseline_name(r.variant)}.{r.spec.mode}")
        graph, pynative = by_name.get(f"{r.variant}.graph"), by_name.get(f"{r.variant}.pynative")
        saving = None if base is None else base.summary.step_time - r.summary.step_time
        theory = None if r.pf is None else (r.nt - 1) * r.pf
        simulated = None if base is None or r.spec.baseline else simulated_saving(r, base)
        out[r.spec.name] = {
            "baseline_run": None if base is None else base.spec.name,
            "ratio_to_baseline": None
            if base is None
            else _ratio(r.summary.step_time, base.summary.step_time),
            "pynative_over_graph": None
            if graph is None or pynative is None
            else _ratio(pynative.summary.step_time, graph.summary.step_time),
            "mpipe": None
            if r.spec.baseline
            else {
                "nt": r.nt,
                "pf_s": r.pf,
                "saving_s": saving,
                "simulated_saving_s": simulated,
                "saving_over_simulated": None
                if saving is None or simulated is None
                else _ratio(saving, simulated),
                "theory_saving_s": theory,
                "saving_share": None if saving is None or not theory else saving / theory,
            },
        }
    return out


def _costs(prediction: Prediction) -> dict[str, Any]:
    c = prediction.costs
    return {
        "forward_s": c.forward,
        "backward_s": c.backward,
        "preprocess_forward_s": c.preprocess_forward,
        "recompute_s": c.recompute,
        "preprocess_backward_s": c.preprocess_backward,
        "broadcast_s": c.broadcast,
        "allreduce_s": c.allreduce,
        "latency_s": c.latency,
        "bandwidth_bytes_per_s": None if math.isinf(c.bandwidth) else c.bandwidth,
        "activation_bytes": c.activation_bytes,
        "preprocess_bytes": c.preprocess_bytes,
        "fused_last_stage": c.fused_last_stage,
        "stage_forward_s": list(c.stage_forward),
        "stage_backward_s": list(c.stage_backward),
    }


def document(
    job: JobSpec, variants: Sequence[str], modes: Sequence[str], results: Sequence[RunResult]
) -> dict:
    """The ``--json`` document (see the module docstring for its schema)."""
    import mindspore

    import graph_exec

    comparisons = _comparisons(results)
    runs = []
    for r in results:
        s = r.summary
        runs.append(
            {
                "name": r.spec.name,
                "variant": r.variant,
                "mode": r.spec.mode,
                "baseline": r.spec.baseline,
                "preprocess": r.spec.preprocess,
                "run_ahead": r.spec.run_ahead,
                "backward": r.spec.backward,
                "keep_preprocess_tape": r.spec.keep_preprocess_tape,
                "step_time_s": s.step_time,
                "step_times_s": list(s.step_times),
                **{k: v for k, v in comparisons[r.spec.name].items() if k != "mpipe"},
                "bubble_fraction": s.bubble,
                "overhead_fraction": s.overhead,
                "dispatch_s": s.dispatch_seconds,
                "compilations": s.compilations,
                "compile_s": s.compile_seconds,
                "allocations_after_warmup": s.allocations_after_warmup,
                "losses": list(s.losses),
                "prediction": {
                    "step_time_s": r.prediction.step_time,
                    "error": r.prediction.error(s.step_time),
                    "bubble_fraction": r.prediction.result.bubble_fraction,
                    "costs": _costs(r.prediction),
                },
                "mpipe": comparisons[r.spec.name]["mpipe"],
            }
        )
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": {
            "python": platform.python_version(),
            "mindspore": mindspore.__version__,
            "graph_exec": graph_exec.__version__,
            "cpus": os.cpu_count() or 0,
        },
        "job": {
            "example": job.example,
            "size": job.size,
            "ranks": job.ranks,
            "dp": job.dp,
            "vpp": job.vpp,
            "micro": job.micro,
            "batch": job.batch,
            "steps": job.steps,
            "warmup": job.warmup,
            "lr": job.lr,
            "variants": list(variants),
            "modes": list(modes),
        },
        "definitions": dict(DEFINITIONS),
        "runs": runs,
    }


# -- printed table ---------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec`` (width first), or a right-aligned ``-``."""
    if value is None or math.isnan(value):
        return "-".rjust(int(spec.lstrip("+").split(".")[0]))
    return f"{value * scale:{spec}}"


def _percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), ``None`` without values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def table(doc: dict) -> str:
    """The bench results as text: the main table (step time as the median with its p10 and p90
    over the measured steps), the MPipe savings, the simulator's inputs."""
    head = (
        f"{'run':30s}{'step ms':>9s}{'p10':>7s}{'p90':>7s}{'/base':>7s}{'pyn/gr':>7s}{'bubble':>7s}{'ovhd':>7s}"
        f"{'pred ms':>9s}{'err':>8s}{'comp':>6s}{'comp s':>8s}{'alloc':>6s}"
    )
    lines = [head, "-" * len(head)]
    for run in doc["runs"]:
        pred = run["prediction"]
        lines.append(
            f"{run['name']:30s}{_fmt(run['step_time_s'], '9.1f', 1e3)}"
            f"{_fmt(_percentile(run['step_times_s'], 10), '7.1f', 1e3)}"
            f"{_fmt(_percentile(run['step_times_s'], 90), '7.1f', 1e3)}"
            f"{_fmt(run['ratio_to_baseline'], '7.2f')}{_fmt(run['pynative_over_graph'], '7.2f')}"
            f"{_fmt(run['bubble_fraction'], '7.0%')}{_fmt(run['overhead_fraction'], '7.1%')}"
            f"{_fmt(pred['step_time_s'], '9.1f', 1e3)}{_fmt(pred['error'], '+8.1%')}"
            f"{run['compilations']:6d}{run['compile_s']:8.1f}{run['allocations_after_warmup']:6d}"
        )
    mpipe = [run for run in doc["runs"] if run["mpipe"] is not None]
    if mpipe:
        lines += [
            "",
            f"{'saving vs fair baseline (ms)':30s}{'measured':>9s}{'simulated':>10s}{'meas/sim':>9s}"
            f"{'Pf':>7s}{'NT':>4s}{'(NT-1)Pf':>9s}{'share':>8s}",
        ]
        for run in mpipe:
            m = run["mpipe"]
            lines.append(
                f"{run['name']:30s}{_fmt(m['saving_s'], '9.1f', 1e3)}{_fmt(m['simulated_saving_s'], '10.1f', 1e3)}"
                f"{_fmt(m['saving_over_simulated'], '9.0%')}{_fmt(m['pf_s'], '7.2f', 1e3)}{m['nt']:4d}"
                f"{_fmt(m['theory_saving_s'], '9.1f', 1e3)}{_fmt(m['saving_share'], '8.0%')}"
            )
        lines += [f"  {name:>9s}: {text}" for name, text in SAVING_LEGEND]
    costs = (
        "forward_s",
        "backward_s",
        "preprocess_forward_s",
        "recompute_s",
        "preprocess_backward_s",
        "broadcast_s",
        "allreduce_s",
    )
    lines += [
        "",
        f"{'simulator inputs (ms)':30s}{'F':>7s}{'B':>7s}{'Pf+snd':>7s}{'R':>7s}{'Pb':>7s}{'BCAST':>7s}"
        f"{'reduce':>7s}{'lat':>7s}{'MB/s':>8s}{'disp':>7s}",
    ]
    for run in doc["runs"]:
        c = run["prediction"]["costs"]
        bandwidth = c["bandwidth_bytes_per_s"]
        lines.append(
            f"{run['name']:30s}"
            + "".join(_fmt(c[k], "7.2f", 1e3) for k in (*costs, "latency_s"))
            + (f"{'inf':>8s}" if bandwidth is None else _fmt(bandwidth, "8.0f", 1e-6))
            + _fmt(run["dispatch_s"], "7.3f", 1e3)
        )
    return "\n".join(lines) + "\n"
