"""``graph-exec run EXAMPLE``: train an example model pipelined over local ranks.

Launches msrun itself (loopback, a free port), trains with Adam, prints one progress line per
step while training runs and a summary at the end; ``--trace`` and ``--plot`` show what every
rank really ran. Compute steps are timed to their completion (``sync_steps``), so the timeline
shows each step's own duration; on CPU that was measured faster too (see ``RankRuntime``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

from graph_exec.cli.argtypes import positive_int
from graph_exec.cli.jobs import (
    JobFailed,
    add_launch_arguments,
    checked_job,
    execute,
    output_file,
    run_directory,
)
from graph_exec.report.analysis import summarize
from graph_exec.report.job import JobSpec, RunSpec
from graph_exec.report.records import read_run
from graph_exec.report.trace import PLOT_EXTRA_HINT, chrome_trace, plot_timeline
from graph_exec.schedule.config import BACKWARD, OVERFLOW

SIZES = ("tiny", "small")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared with ``graph-exec bench``."""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--ranks", metavar="N", type=positive_int, default=2, help="pipeline ranks (default 2)"
    )
    group.add_argument(
        "--vpp", metavar="V", type=positive_int, default=2, help="model chunks per rank (default 2)"
    )
    group.add_argument(
        "--micro", metavar="M", type=positive_int, help="micro-batches per step (default 2 x ranks)"
    )
    group.add_argument(
        "--batch", metavar="B", type=positive_int, help="samples per step, a multiple of M (default 2 x M)"
    )
    group.add_argument("--size", choices=SIZES, default="tiny", help="model size preset (default tiny)")
    group.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")


def workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, int]:
    """``(micro, batch)`` with their defaults filled in; an impossible pair exits with code 2."""
    micro = args.micro or 2 * args.ranks
    batch = args.batch or 2 * micro
    if batch % micro:
        parser.error(
            f"--batch {batch} is not a multiple of --micro {micro}: every micro-batch needs equal rows"
        )
    return micro, batch


def register(subparsers: argparse._SubParsersAction) -> None:
    from graph_exec.examples import EXAMPLES

    parser = subparsers.add_parser(
        "run",
        help="train an example model pipelined over local ranks",
        description="Launch msrun on this machine and train an example with the MPipe Transpose "
        "schedule (or the interleaved-1F1B baseline), printing progress and a summary.",
    )
    parser.add_argument("example", choices=tuple(EXAMPLES), help="the example model")
    add_model_arguments(parser)
    group = parser.add_argument_group("schedule")
    group.add_argument(
        "--mode", choices=("graph", "pynative"), default="graph", help="executor (default graph)"
    )
    group.add_argument(
        "--steps", metavar="K", type=positive_int, default=8, help="training steps (default 8)"
    )
    group.add_argument("--overflow", choices=OVERFLOW, help="micro-batches beyond NT (default full)")
    group.add_argument("--backward", choices=BACKWARD, help="preprocess backward (default central)")
    train = group.add_mutually_exclusive_group()
    train.add_argument(
        "--frozen", dest="trainable", action="store_false", help="freeze the preprocess (vl_tower's default)"
    )
    train.add_argument(
        "--trainable", dest="trainable", action="store_true", help="train the preprocess (embed_lm's default)"
    )
    parser.set_defaults(trainable=None)
    group.add_argument(
        "--baseline", action="store_true", help="interleaved 1F1B with the preprocess in stage 0 (no MPipe)"
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--trace", metavar="FILE", type=output_file, help="write every rank's timeline (chrome trace)"
    )
    out.add_argument("--plot", metavar="FILE.png", type=output_file, help="draw the last step of every rank")
    add_launch_arguments(parser, timeout_s=300)
    parser.set_defaults(func=lambda args: _run(args, parser))


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    """The job ``args`` describe, checked the way the workers would check it (exit 2 if not)."""
    from graph_exec.examples import TRAINABLE_BY_DEFAULT

    micro, batch = workload(args, parser)
    if args.baseline and (args.overflow or args.backward):
        parser.error("--baseline runs without MPipe: --overflow and --backward do not apply")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}")
    trainable = TRAINABLE_BY_DEFAULT[args.example] if args.trainable is None else args.trainable
    spec = RunSpec(
        name="run",
        mode=args.mode,
        baseline=args.baseline,
        trainable=trainable,
        overflow=args.overflow or "full",
        backward=args.backward or "central",
    )
    steps, warmup = (args.steps - 1, 1) if args.steps > 1 else (1, 0)
    return checked_job(args, parser, (spec,), micro=micro, batch=batch, steps=steps, warmup=warmup)


def describe(job: JobSpec) -> str:
    """One line saying what is being trained."""
    spec = job.runs[0]
    schedule = (
        "interleaved 1F1B baseline (preprocess in stage 0)"
        if spec.baseline
        else f"MPipe overflow={spec.overflow} backward={spec.backward}"
    )
    return (
        f"{job.example} ({job.size}, {'trainable' if spec.trainable else 'frozen'} preprocess) on "
        f"{job.ranks} ranks, {spec.mode} mode, V={job.vpp} M={job.micro} batch {job.batch}, {schedule}"
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    job = job_from_args(args, parser)
    print(describe(job), flush=True)
    total = job.total_steps

    def progress(line: dict) -> None:
        loss = "-" if line["loss"] is None else f"{line['loss']:.4f}"
        print(
            f"step {line['step'] + 1:>3}/{total}  loss {loss}  step time {line['seconds'] * 1e3:8.1f} ms",
            flush=True,
        )

    began = time.monotonic()
    try:
        with run_directory(args.log_dir) as run_dir:
            execute(job, run_dir, args.timeout, progress, "graph-exec run")
            _report(args, job, run_dir, time.monotonic() - began)
    except JobFailed as failed:
        return failed.code
    return 0


def _report(args: argparse.Namespace, job: JobSpec, run_dir: Path, total_s: float) -> None:
    """The summary, the trace and the plot of a finished run."""
    total = job.total_steps
    records = read_run(run_dir, "run", job.ranks)
    summary = summarize(records, job.warmup, job.ranks * job.vpp - 1)
    print(f"done: {total} steps in {total_s:.1f} s, including start-up and compilation")
    print(f"loss: {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}")
    measured = {0: "all steps", total - 1: f"step {total}"}.get(job.warmup, f"steps {job.warmup + 1}-{total}")
    print(f"median step time: {summary.step_time * 1e3:.1f} ms ({measured}; first rank in to last rank out)")
    print(f"compilations: {summary.compilations} ({summary.compile_seconds:.1f} s, summed over ranks)")
    if job.warmup:
        print(f"receive-buffer allocations after warm-up: {summary.allocations_after_warmup}")
    if args.trace:
        args.trace.write_text(json.dumps(chrome_trace(records, describe(job))), encoding="utf-8")
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        plot_timeline(records, -1, args.plot, f"{job.example} {job.runs[0].mode}")
        print(f"timeline of the last step drawn in {args.plot}")
    if args.log_dir:
        print(f"logs and per-rank records in {run_dir}")
