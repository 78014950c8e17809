"""``graph-exec bench qwen2vl --tower-ratio R[,R…]``: the tower-ratio sweep (see
:mod:`graph_exec.report.tower_sweep` for what is run, measured and simulated).

The parent first runs the start-up calibration (:mod:`graph_exec.harness.tower_costs`, one
process bound to one core), then one launch per ratio with that ratio's vision depth and
rebalanced split, and prints the sweep's table; ``--json`` and ``--plot`` save it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from graph_exec.balance import rebalanced_layers
from graph_exec.cli.jobs import JobFailed, checked_job, execute, nodes_of, run_directory
from graph_exec.cli.run import workload
from graph_exec.device import DevicePolicy
from graph_exec.executors import MODES
from graph_exec.harness.tower_costs import RESULT
from graph_exec.report import tower_sweep
from graph_exec.report.bench_report import VARIANTS, evaluate
from graph_exec.report.job import RunSpec
from graph_exec.report.tower_sweep import StartupCosts, SweepPoint

#: The example whose tower the sweep scales.
EXAMPLE = "qwen2vl"


def ratios(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated tower ratios, each a number > 0."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"tower ratios must be numbers > 0, got {text!r}") from None
    if not values or any(not 0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"tower ratios must be numbers > 0, got {text!r}")
    return values


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What the sweep cannot do, before anything starts (exit 2)."""
    if args.example != EXAMPLE:
        parser.error(f"--tower-ratio scales the vision tower of {EXAMPLE!r}, not of {args.example!r}")
    if args.dp != 1 or args.nodes != 1:
        parser.error("--tower-ratio measures one pipeline on this host: --dp and --nodes must be 1")
    if args.ranks < 2:
        parser.error(f"--tower-ratio compares pipelines: --ranks must be at least 2, got {args.ranks}")
    if args.variants == tuple(VARIANTS):  # the bench's default: every variant
        args.variants = tuple(tower_sweep.MPIPE)
    elif set(args.variants) - set(tower_sweep.MPIPE):
        parser.error(
            f"--tower-ratio runs the frozen tower: --variants may only name {', '.join(tower_sweep.MPIPE)}"
        )
    if args.modes == MODES:  # the bench's default: both; the sweep measures graph mode
        args.modes = ("graph",)


def calibrate(
    size: str, num_stages: int, rows: int, device: str, pin: bool, timeout_s: float
) -> StartupCosts:
    """The start-up costs, measured in a process of its own on ``device``."""
    command = [
        sys.executable,
        "-m",
        "graph_exec.harness.tower_costs",
        size,
        str(num_stages),
        str(rows),
        device,
    ]
    done = subprocess.run(
        [*command, *(["pin"] if pin else [])], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return StartupCosts(**json.loads(line[len(RESULT) :]))
    raise RuntimeError(f"the start-up calibration failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def runs(
    variants: tuple[str, ...], modes: tuple[str, ...], rebalanced: tuple[int, ...]
) -> tuple[RunSpec, ...]:
    out = []
    for mode in modes:
        out.append(RunSpec(name=f"baseline-frozen.{mode}", mode=mode, baseline=True))
        out.append(RunSpec(name=f"baseline-rebalanced.{mode}", mode=mode, baseline=True, layers=rebalanced))
        out += [RunSpec(name=f"{v}.{mode}", mode=mode, run_ahead=tower_sweep.MPIPE[v]) for v in variants]
    return tuple(out)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check(args, parser)
    from graph_exec.examples import qwen2vl

    micro, batch = workload(args, parser)
    pp, vpp = args.ranks, args.vpp
    num_stages = pp * vpp
    num_layers = max(qwen2vl.SIZES[args.size].layers, num_stages)
    mode = "graph" if "graph" in args.modes else args.modes[0]
    print(
        f"tower sweep of {EXAMPLE} ({args.size}), P={pp} V={vpp} M={micro} batch {batch}: calibrating",
        flush=True,
    )
    pin = args.pin_cores and DevicePolicy.for_target(args.device).pin_cores
    costs = calibrate(args.size, num_stages, batch // micro, args.device, pin, args.timeout)
    try:  # every ratio's depth before the first launch: one off the scale stops nothing mid-sweep
        depths = [costs.depth_for(ratio) for ratio in args.tower_ratio]
    except ValueError as exc:
        print(f"graph-exec bench: {exc}", file=sys.stderr)
        return 2
    points: list[SweepPoint] = []
    try:
        for ratio, depth in zip(args.tower_ratio, depths, strict=True):
            tower = costs.tower(depth)
            rebalanced = rebalanced_layers(num_layers, pp, vpp, costs.layer_step, [tower])
            job = checked_job(
                args,
                parser,
                runs(args.variants, args.modes, rebalanced),
                micro=micro,
                batch=batch,
                steps=args.steps,
                warmup=args.warmup,
                calibrate=True,
            )
            job = dataclasses.replace(job, model_options={"vision_depth": depth})
            print(
                f"R={ratio:g}: {depth} vision blocks (tower ~{tower * 1e3:.1f} ms), rebalanced split "
                f"{list(rebalanced)}: {len(job.runs)} runs x {job.total_steps} steps",
                flush=True,
            )
            with run_directory(_log_dir(args.log_dir, ratio)) as run_dir:
                execute(
                    job, run_dir, args.timeout, lambda line: None, "graph-exec bench", nodes_of(args, parser)
                )
                results = evaluate(job, run_dir)
            points.append(
                tower_sweep.sweep_point(
                    ratio, depth, tower, rebalanced, results, mode, pp, vpp, micro, num_layers
                )
            )
    except JobFailed as failed:
        return failed.code
    sys.stdout.write("\n" + tower_sweep.table(points, costs, pp))
    if args.json:
        doc = tower_sweep.document(points, costs, pp, vpp, micro)
        args.json.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        print(f"\nresults written to {args.json}")
    if args.plot:
        tower_sweep.plot(points, args.plot, pp)
        print(f"plot written to {args.plot}")
    return 0


def _progress(ratio: float, names: list[str], total: int, warmup: int) -> Callable[[dict], None]:
    """A line per step once every run has finished it: each run's step time."""
    seen: dict[int, dict[str, float]] = {}

    def show(line: dict) -> None:
        times = seen.setdefault(line["step"], {})
        times[line["run"]] = line["seconds"]
        if len(times) == len(names):
            phase = "warm-up" if line["step"] < warmup else "measured"
            runs = ", ".join(f"{name.rsplit('.', 1)[0]} {times[name] * 1e3:.0f}" for name in names)
            print(f"R={ratio:g} step {line['step'] + 1}/{total} ({phase}, ms): {runs}", flush=True)

    return show


def _log_dir(root: Path | None, ratio: float) -> Path | None:
    return None if root is None else root / f"tower_ratio_{ratio:g}"
