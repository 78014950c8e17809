"""``graph-exec bench [EXAMPLE]``: MPipe variants against the fair baseline.

The fair baseline is ``ScheduleInterleaved1F1B`` with the same preprocess run on rank 0 right
before ``F 0.m`` (frozen: forward only; trainable: its backward from the tape right after
``B 0.m``), so a variant's saving is what transposition buys. One msrun launch trains every run
(each variant in each mode, plus the baselines they are compared with) on the same workload, step by step in turn so machine noise hits them alike,
with every compute step timed to its completion. The parent then merges the ranks' records
and prints the table, the MPipe savings and the simulator's inputs; ``--json`` saves it all
(schema in :mod:`graph_exec.report.bench_report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable

from graph_exec.cli import image_mix_bench, tower_sweep
from graph_exec.cli.argtypes import positive_int
from graph_exec.cli.jobs import (
    JobFailed,
    add_launch_arguments,
    checked_job,
    execute,
    nodes_of,
    output_file,
    run_directory,
)
from graph_exec.cli.run import add_model_arguments, workload
from graph_exec.executors import MODES
from graph_exec.report import image_mix
from graph_exec.report.bench_report import VARIANTS, document, evaluate, runs_for, table
from graph_exec.report.bench_schema import check
from graph_exec.report.job import JobSpec
from graph_exec.report.memory import memory_lines
from graph_exec.report.records import read_run
from graph_exec.report.trace import PLOT_EXTRA_HINT
from graph_exec.schedule.config import BODY


def _names(allowed: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """argparse type: a comma-separated, non-empty list drawn from ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            bad = ", ".join(map(repr, unknown)) or repr(text)
            raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from: {','.join(allowed)}")
        return names

    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    from graph_exec.examples import EXAMPLES

    parser = subparsers.add_parser(
        "bench",
        help="benchmark MPipe variants against the fair baseline (no transposition)",
        description="Train the fair baseline (interleaved 1F1B, the same preprocess run on rank 0, "
        "nothing transposed) and MPipe variants side by side in one launch and report step time, "
        "ratios, bubble, runtime overhead, compilations, allocations, the simulator's prediction "
        "from the measured per-op costs, and each variant's saving: measured, simulated and (NT-1)*Pf.",
    )
    parser.add_argument(
        "example",
        nargs="?",
        default="vl_tower",
        choices=tuple(EXAMPLES),
        help="the example (default vl_tower)",
    )
    add_model_arguments(parser)
    _add_run_arguments(parser)
    _add_qwen2vl_arguments(parser)
    add_launch_arguments(parser, timeout_s=1200)
    parser.set_defaults(func=lambda args: _run(args, parser))


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What every bench run takes: its length, variants, modes, body and the JSON file."""
    parser.add_argument(
        "--steps", metavar="K", type=positive_int, default=8, help="measured steps per run (default 8)"
    )
    parser.add_argument(
        "--warmup",
        metavar="W",
        type=positive_int,
        default=3,
        help="steps per run before measuring, at least 1: the first one compiles (default 3)",
    )
    parser.add_argument(
        "--variants",
        type=_names(tuple(VARIANTS), "variant"),
        default=tuple(VARIANTS),
        help=f"comma-separated MPipe variants (default all: {','.join(VARIANTS)}); "
        "the baselines they compare with are added",
    )
    parser.add_argument(
        "--modes",
        type=_names(MODES, "mode"),
        default=MODES,
        help=f"comma-separated (default {','.join(MODES)}); with --image-mix the first of them "
        "(graph if named: pynative compiles nothing, for a quick run of the whole bench)",
    )
    parser.add_argument(
        "--body",
        choices=BODY,
        default="interleaved",
        help="pipeline body of every run, baselines included (default interleaved; zb: zero bubble)",
    )
    parser.add_argument(
        "--json", metavar="FILE", type=output_file, help="save every number (schema version 2)"
    )


def _add_qwen2vl_arguments(parser: argparse.ArgumentParser) -> None:
    """The qwen2vl sweeps: the tower's cost (``--tower-ratio``) and image mixes (``--image-mix``)."""
    parser.add_argument(
        "--tower-ratio",
        metavar="R[,R...]",
        type=tower_sweep.ratios,
        help="qwen2vl: scale the vision tower so its forward is R x one chunk's forward (measured at "
        "start-up) and run MPipe frozen-full/min against the even-split and the rebalanced baseline, "
        "one launch per R, with P=4 and 8 simulated from the measured costs",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", type=output_file, help="with --tower-ratio: step time against R"
    )
    parser.add_argument(
        "--image-mix",
        choices=image_mix.MIXES,
        help="qwen2vl: images of a mix defined by measured cost (skewed: a rare heavy micro-batch with "
        "4x the patches; uniform: all the same), the mean tower 2x a chunk's forward; MPipe with each "
        "--tower-order against the even-split and rebalanced baselines at M=4 and 8, simulated at P=4 and 8",
    )
    parser.add_argument(
        "--vision-depth",
        metavar="N",
        type=positive_int,
        help="with --image-mix: a light micro-batch's tower has N vision blocks instead of the depth "
        "calibrated for the mix (the same tower on every machine, however loaded)",
    )
    parser.add_argument(
        "--tower-order",
        type=image_mix_bench.orders,
        help="with --image-mix: comma-separated MPipe tower orders (default arrival,balanced)",
    )
    parser.add_argument(
        "--padding",
        choices=image_mix_bench.PADDINGS,
        help="with --image-mix: pad each micro-batch to its own sizes (micro: its tower runs at its "
        "own patch count) or the whole batch to its largest (batch) (default micro)",
    )
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --image-mix: also MPipe (balanced tower order) on the mix packed into rows, balanced by "
        "tower cost against rows packed by tokens alone; prints real tokens/s, padding fraction and the "
        "micro-batches' tower cost max/mean (default: --no-packing)",
    )


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    """The bench job ``args`` describe; an impossible configuration exits with code 2."""
    micro, batch = workload(args, parser)
    runs = tuple(dataclasses.replace(spec, body=args.body) for spec in runs_for(args.variants, args.modes))
    return checked_job(
        args, parser, runs, micro=micro, batch=batch, steps=args.steps, warmup=args.warmup, calibrate=True
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.plot and not args.tower_ratio:
        parser.error("--plot draws the --tower-ratio sweep; pass --tower-ratio R[,R...]")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}")
    if args.tower_order and not args.image_mix:
        parser.error("--tower-order goes with --image-mix (the costs it places by)")
    if args.padding and not args.image_mix:
        parser.error("--padding goes with --image-mix (the batches it draws)")
    if args.vision_depth and not args.image_mix:
        parser.error("--vision-depth goes with --image-mix (--tower-ratio calibrates the depth per ratio)")
    if args.packing and not args.image_mix:
        parser.error("--packing goes with --image-mix (the samples it packs)")
    if args.image_mix:
        return image_mix_bench.run(args, parser)
    if args.tower_ratio:
        return tower_sweep.run(args, parser)
    job = job_from_args(args, parser)
    names = [spec.name for spec in job.runs]
    print(
        f"bench {job.example} ({job.size}) on {job.ranks} ranks ({job.mesh}), V={job.vpp} M={job.micro} "
        f"batch {job.batch}: "
        f"{len(names)} runs x ({job.warmup} warm-up + {job.steps} measured steps)",
        flush=True,
    )
    seen: dict[int, dict[str, float]] = {}

    def progress(line: dict) -> None:
        times = seen.setdefault(line["step"], {})
        times[line["run"]] = line["seconds"]
        if len(times) == len(names):
            phase = "warm-up" if line["step"] < job.warmup else "measured"
            fastest, slowest = min(times, key=times.get), max(times, key=times.get)
            print(
                f"step {line['step'] + 1:>2}/{job.total_steps} ({phase}): fastest {fastest} "
                f"{times[fastest] * 1e3:.0f} ms, slowest {slowest} {times[slowest] * 1e3:.0f} ms",
                flush=True,
            )

    try:
        with run_directory(args.log_dir) as run_dir:
            execute(job, run_dir, args.timeout, progress, "graph-exec bench", nodes_of(args, parser))
            doc = document(job, args.variants, args.modes, evaluate(job, run_dir))
            memory = {spec.name: memory_lines(read_run(run_dir, spec.name, job.ranks)) for spec in job.runs}
    except JobFailed as failed:
        return failed.code
    problems = check(doc)
    if problems:  # a bug in this command, not in the user's input
        print(
            "graph-exec bench: the report does not match its schema:\n  " + "\n  ".join(problems),
            file=sys.stderr,
        )
        return 1
    sys.stdout.write("\n" + table(doc))
    print("\nmemory per rank (the last step's peaks):")
    for name, lines in memory.items():
        for line in lines:
            print(f"  {name} {line}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        print(f"\nresults written to {args.json}")
    return 0
