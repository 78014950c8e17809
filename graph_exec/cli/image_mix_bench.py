"""``graph-exec bench qwen2vl --image-mix uniform|skewed --tower-order arrival,balanced``.

The mix is defined by measured cost (:mod:`graph_exec.report.image_mix`): the parent runs the
start-up calibration of ``--tower-ratio`` (:mod:`graph_exec.harness.tower_costs`), picks the
vision depth that makes the mean micro-batch's tower forward 2x a chunk's forward (or takes
``--vision-depth``: a tower that does not follow the machine's load), and then, per
``M`` (4 and 8 unless ``--micro`` names one), one launch trains side by side, step by step in
turn: the even-split and the rebalanced baselines and MPipe (``run_ahead="full"``) with each
``--tower-order``, every rank building the same batch and reading each micro-batch's tower cost
from it (its real patches times the calibrated cost of a light micro-batch). It prints each
run's step time (p10/p50/p90 over the measured steps), the ratios, and the simulator's
balanced/arrival ratio at P = 4 and 8 from the launch's measured costs with the mix's costs per
micro-batch.

``--packing`` adds two MPipe runs (``tower_order="balanced"``) to each launch on the same mix packed
into rows (:func:`graph_exec.data.pack`, rows of a heavy and a light sample's tokens): ``packed-tower``
(rows balanced by tower cost) and ``packed-tokens`` (rows by tokens alone), and prints each one's
real tokens per second, padding fraction and micro-batches' tower cost max/mean (from the step
lines of the measured steps): the step time of the balance target with ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace

from graph_exec.balance import rebalanced_layers
from graph_exec.cli import tower_sweep as sweep_cli
from graph_exec.cli.jobs import JobFailed, checked_job, execute, nodes_of, run_directory
from graph_exec.device import DevicePolicy
from graph_exec.report import image_mix
from graph_exec.report.bench_report import RunResult, evaluate
from graph_exec.report.job import RunSpec
from graph_exec.report.tower_sweep import StartupCosts, even, layer_costs, percentiles, stage_costs
from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.schedule.placement import TOWER_ORDERS
from graph_exec.simulate import simulate

EXAMPLE = "qwen2vl"
#: ``M`` of the launches unless ``--micro`` names one.
MICROS = (4, 8)
SIMULATED_RANKS = (4, 8)
BASELINES = ("baseline-frozen", "baseline-rebalanced")
#: ``--padding``: each micro-batch to its own sizes, or the whole batch to its largest.
PADDINGS = ("micro", "batch")
#: ``--packing``: the packed runs' balances (``graph_exec.data.pack``).
PACK_BALANCES = ("tower", "tokens")


def orders(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated tower orders."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names or set(names) - set(TOWER_ORDERS):
        raise argparse.ArgumentTypeError(f"tower orders must be among {','.join(TOWER_ORDERS)}, got {text!r}")
    return names


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What the mix bench cannot do, before anything starts (exit 2)."""
    if args.example != EXAMPLE:
        parser.error(f"--image-mix draws the images of {EXAMPLE!r}, not of {args.example!r}")
    if args.dp != 1 or args.nodes != 1:
        parser.error("--image-mix measures one pipeline on this host: --dp and --nodes must be 1")
    if args.ranks < 2:
        parser.error(f"--image-mix compares pipelines: --ranks must be at least 2, got {args.ranks}")
    if args.tower_ratio:
        parser.error("--image-mix sets the tower's depth itself: drop --tower-ratio")


def mix_runs(
    tower_orders: Sequence[str], rebalanced: tuple[int, ...], packing: bool = False, mode: str = "graph"
) -> tuple[RunSpec, ...]:
    """The baselines, then MPipe with each tower order; with ``packing`` MPipe on rows balanced
    by tower cost and on rows packed by tokens alone. ``mode`` is graph for a measurement;
    pynative (``--modes pynative``) compiles nothing, for a quick run of the whole bench."""
    return (
        RunSpec(name=f"baseline-frozen.{mode}", mode=mode, baseline=True),
        RunSpec(name=f"baseline-rebalanced.{mode}", mode=mode, baseline=True, layers=rebalanced),
        *(
            RunSpec(name=f"mpipe-{order}.{mode}", mode=mode, run_ahead="full", tower_order=order)
            for order in tower_orders
        ),
        *(
            RunSpec(
                name=f"packed-{way}.{mode}",
                mode=mode,
                run_ahead="full",
                tower_order="balanced",
                pack_balance=way,
            )
            for way in (PACK_BALANCES if packing else ())
        ),
    )


def packed_figures(lines: Sequence[dict], warmup: int) -> dict[str, tuple[float, float, float]]:
    """Per packed run, from its measured steps' progress lines: real tokens per second (all real
    tokens over all step seconds), the padding fraction of its row slots and the mean of the
    micro-batches' tower cost max/mean."""
    out = {}
    for way in PACK_BALANCES:
        name = f"packed-{way}"
        steps = [
            x
            for x in lines
            if str(x.get("run")).split(".")[0] == name and x.get("step", -1) >= warmup and "tokens" in x
        ]
        if not steps:
            continue
        real = sum(x["tokens"]["real"] for x in steps)
        slots = sum(x["tokens"]["padded"] for x in steps)
        seconds = sum(x["seconds"] for x in steps)
        spread = statistics.fmean(x.get("tower_spread", 1.0) for x in steps)
        out[f"packed-{way}"] = (real / seconds, 1.0 - real / slots, spread)
    return out


def simulated_ratio(
    results: Sequence[RunResult],
    mix: str,
    micro: int,
    pp: int,
    vpp: int,
    num_layers: int,
    light_tower: float,
    steps: Sequence[int],
) -> dict[int, tuple[float, float]]:
    """Per simulated rank count: means over ``steps`` of the simulated arrival / balanced step
    time, and of arrival / the same plan with every tower free.

    The second is the *ceiling*: no placement of the towers can make the step shorter than
    towers that cost nothing, so no order can beat arrival by more than that ratio.
    Everything but the towers is the launch's measured costs (the arrival run's, its layers
    scaled with the pipeline as in ``--tower-ratio``: ``L' = L·P'/P``, ``M' = M·P'/P``); each
    micro-batch's tower is ``light_tower`` (the calibrated light micro-batch) times its weight
    in the mix.
    """
    by_name = {r.variant: r for r in results}
    arrival = by_name["mpipe-arrival"].prediction.costs
    layers = layer_costs(by_name["baseline-frozen"].prediction.costs, even(num_layers, pp * vpp))
    out = {}
    for ranks in SIMULATED_RANKS:
        sim_micro, sim_layers = micro * ranks // pp, num_layers * ranks // pp
        forward, backward = stage_costs(layers, even(sim_layers, ranks * vpp))
        plan = build_plan(
            PlanConfig(pp=ranks, vpp=vpp, micro=sim_micro, preprocess="frozen", run_ahead="full")
        )
        body_only = simulate(
            plan, replace(arrival, stage_forward=forward, stage_backward=backward, preprocess_forward=0.0)
        ).step_time
        ratios, ceilings = [], []
        for step in steps:
            costs = replace(
                arrival,
                stage_forward=forward,
                stage_backward=backward,
                preprocess_forward=light_tower,
                tower_costs=image_mix.micro_weights(mix, sim_micro, step),
            )
            in_arrival = simulate(plan, costs, "arrival").step_time
            ratios.append(in_arrival / simulate(plan, costs, "balanced").step_time)
            ceilings.append(in_arrival / body_only)
        out[ranks] = (statistics.fmean(ratios), statistics.fmean(ceilings))
    return out


def table(
    mix: str,
    padding: str,
    costs: StartupCosts,
    points: Sequence[
        tuple[
            int,
            int,
            float,
            dict[str, tuple[float, float, float]],
            dict[int, tuple[float, float]],
            dict[str, tuple[float, float, float]],
        ]
    ],
    pp: int,
) -> str:
    """The measured step times and ratios side by side, then the simulator's ratios."""
    lines = [
        f"image mix {mix!r}: mean tower forward per micro-batch {image_mix.MEAN_RATIO:g}x a chunk's forward "
        f"(chunk forward {costs.chunk_forward * 1e3:.2f} ms at start-up), heavy micro-batches "
        f"{image_mix.HEAVY_FACTOR}x the patches of a light one; "
        + (
            "each micro-batch padded to its own sizes"
            if padding == "micro"
            else "the batch padded as a whole"
        ),
        f"measured at P={pp} (step ms p10/p50/p90 over the measured steps; ratio = other / balanced p50)",
    ]
    for micro, depth, light, measured, sims, packed in points:
        heavy = image_mix.heavy_count(mix, micro)
        lines.append(
            f"M={micro}: {depth} vision blocks (light micro-batch tower ~{light * 1e3:.1f} ms), "
            f"{heavy} heavy of {micro} per step"
        )
        for name, (p10, p50, p90) in measured.items():
            lines.append(f"  {name:22s} {p10 * 1e3:7.1f} {p50 * 1e3:7.1f} {p90 * 1e3:7.1f}")
        if "mpipe-balanced" in measured:
            base = measured["mpipe-balanced"][1]
            lines.append(
                "  ratios to balanced: "
                + ", ".join(
                    f"{name} {p50 / base:.3f}x"
                    for name, (_, p50, _) in measured.items()
                    if name != "mpipe-balanced"
                )
            )
        for name, (rate, padding_fraction, spread) in packed.items():
            lines.append(
                f"  {name}: real tokens/s {rate:.0f}, padding fraction {padding_fraction:.3f}, "
                f"tower cost max/mean {spread:.2f}"
            )
        if sims:
            lines.append(
                "  simulated balanced speed-up over arrival: "
                + ", ".join(f"P={ranks} {ratio:.3f}x" for ranks, (ratio, _) in sims.items())
            )
            lines.append(
                "  ceiling of any placement (arrival / towers free): "
                + ", ".join(f"P={ranks} {ceiling:.3f}x" for ranks, (_, ceiling) in sims.items())
            )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check(args, parser)
    from graph_exec.examples import qwen2vl

    pp, vpp = args.ranks, args.vpp
    num_stages = pp * vpp
    num_layers = max(qwen2vl.SIZES[args.size].layers, num_stages)
    micros = (args.micro,) if args.micro else MICROS
    rows = args.batch // micros[0] if args.batch else 1
    if args.batch and any(args.batch % m for m in micros):
        parser.error(f"--batch {args.batch} is not a multiple of --micro {micros[0]}")
    tower_orders = args.tower_order or TOWER_ORDERS
    padding = args.padding or PADDINGS[0]
    mode = "graph" if "graph" in args.modes else args.modes[0]
    print(
        f"image-mix bench of {EXAMPLE} ({args.size}), P={pp} V={vpp} M={','.join(map(str, micros))}: calibrating",
        flush=True,
    )
    pin = args.pin_cores and DevicePolicy.for_target(args.device).pin_cores
    costs = sweep_cli.calibrate(args.size, num_stages, rows, args.device, pin, args.timeout)
    try:
        depths = [
            args.vision_depth or costs.depth_for(image_mix.light_ratio(args.image_mix, m)) for m in micros
        ]
    except ValueError as exc:
        print(f"graph-exec bench: {exc}", file=sys.stderr)
        return 2
    points = []
    try:
        for micro, depth in zip(micros, depths, strict=True):
            points.append(
                _measure(args, parser, costs, micro, depth, num_layers, rows, tower_orders, padding, mode)
            )
    except JobFailed as failed:
        return failed.code
    sys.stdout.write("\n" + table(args.image_mix, padding, costs, points, pp))
    return 0


def _measure(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    costs: StartupCosts,
    micro: int,
    depth: int,
    num_layers: int,
    rows: int,
    tower_orders: Sequence[str],
    padding: str,
    mode: str,
) -> tuple:
    """One point of the table: the runs of ``micro`` micro-batches with ``depth`` vision blocks on
    a split rebalanced for the mix's mean tower, launched and read back, with the simulator's
    ratios when every tower order ran. Raises ``JobFailed`` when the job does."""
    pp, vpp = args.ranks, args.vpp
    light = costs.tower(depth)
    mean = light * image_mix.mean_weight(args.image_mix, micro)
    rebalanced = rebalanced_layers(num_layers, pp, vpp, costs.layer_step, [mean])
    job = checked_job(
        args,
        parser,
        mix_runs(tower_orders, rebalanced, args.packing, mode),
        micro=micro,
        batch=rows * micro,
        steps=args.steps,
        warmup=args.warmup,
        calibrate=True,
    )
    options = {
        "vision_depth": depth,
        "image_mix": args.image_mix,
        "mix_micro": micro,
        "tower_unit": light / costs.chunk_forward,
        "pad_per_micro": padding == "micro",
    }
    job = dataclasses.replace(job, model_options=options)
    print(
        f"M={micro}: {depth} vision blocks, rebalanced split {list(rebalanced)}: "
        f"{len(job.runs)} runs x {job.total_steps} steps",
        flush=True,
    )
    lines: list[dict] = []
    with run_directory(args.log_dir / f"image_mix_M{micro}" if args.log_dir else None) as run_dir:
        execute(job, run_dir, args.timeout, lines.append, "graph-exec bench", nodes_of(args, parser))
        results = evaluate(job, run_dir)
    measured = {r.variant: percentiles(r.summary.step_times) for r in results}
    sims = (
        simulated_ratio(
            results,
            args.image_mix,
            micro,
            pp,
            vpp,
            num_layers,
            light,
            range(job.warmup, job.total_steps),
        )
        if set(TOWER_ORDERS) <= set(tower_orders)
        else {}
    )
    return (micro, depth, light, measured, sims, packed_figures(lines, job.warmup))
