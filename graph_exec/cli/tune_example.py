"""``graph-exec tune EXAMPLE``: calibrate a built-in example, search, and (``--verify``) measure.

1. Compute and sizes: :mod:`graph_exec.harness.model_costs` in a process of its own, bound to
   one core as a rank is (the tower sweep's start-up calibration, generalised). With
   ``--tower-ratio R`` (qwen2vl) the sweep's own calibration
   (:func:`graph_exec.cli.tower_sweep.calibrate`) first picks the vision depth whose tower is R
   chunk forwards.
2. In the pipeline: a short launch of the fair baseline through the bench harness
   (``calibrate`` job) per micro-batch count searched at ``V = 2``, and one at ``V = 1`` (with a
   trainable preprocess the first also runs MPipe): the compute per layer, per stage call, per
   stage extra and per micro-batch size, the
   per-step overhead and the transfers' latency and bandwidth
   (:func:`graph_exec.report.predict.measured_costs`); ``--latency``/``--bandwidth`` skip them.
3. The cost file is written (``--save-costs``; edit it and rerun with ``--costs``), every
   candidate is simulated, and the best that fit are printed.
4. ``--verify``: the best three, and the best of each other family (MPipe, the fair and the
   rebalanced baseline), run through the bench harness (ranks pinned), one launch per distinct
   ``(V, M)``; predicted against measured, whether the chosen plan is within :data:`WITHIN` of
   the fastest, and whether MPipe was chosen exactly where it measured faster.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from graph_exec.cli.argtypes import positive_int
from graph_exec.cli.jobs import (
    JobFailed,
    add_launch_arguments,
    execute,
    output_file,
    peer_timeout,
    run_directory,
)
from graph_exec.report.job import JobSpec, RunSpec
from graph_exec.simulate import OpCosts
from graph_exec.tune import SPLITTABLE, CostFileError, ModelCosts, NoPlanFitsError, Predicted, table, tune

#: The chosen plan counts as the right choice within this factor of the fastest verified.
WITHIN = 1.03
#: Candidates ``--verify`` runs.
VERIFIED = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("EXAMPLE (calibrated by measurement)")
    group.add_argument("--size", choices=("tiny", "small"), default="tiny", help="model size preset")
    group.add_argument(
        "--tower-ratio",
        metavar="R",
        type=float,
        help="qwen2vl: vision blocks so that the tower's forward is R x one chunk's forward",
    )
    group.add_argument(
        "--save-costs",
        metavar="FILE",
        type=output_file,
        help="where the calibrated cost file goes (default EXAMPLE-costs.json here)",
    )
    group.add_argument(
        "--latency", metavar="S", type=float, help="per transfer; with --bandwidth: no transfer launch"
    )
    group.add_argument("--bandwidth", metavar="B/S", type=float, help="bytes per second of a transfer")
    group.add_argument(
        "--verify",
        action="store_true",
        help=f"run the best {VERIFIED} and the best of each other family (schedule, split) and measure them",
    )
    group.add_argument("--steps", metavar="K", type=positive_int, default=12, help="measured steps per run")
    group.add_argument("--warmup", metavar="W", type=positive_int, default=2, help="steps before measuring")
    add_launch_arguments(parser, timeout_s=900)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from graph_exec.examples import EXAMPLES

    if args.example not in EXAMPLES:
        parser.error(f"unknown example {args.example!r}; choose one of: {', '.join(EXAMPLES)}")
    if args.tower_ratio is not None and args.example != "qwen2vl":
        parser.error(f"--tower-ratio scales the vision tower of 'qwen2vl', not of {args.example!r}")
    if args.tower_ratio is not None and not 0 < args.tower_ratio < math.inf:
        parser.error(f"--tower-ratio must be a number > 0, got {args.tower_ratio:g}")
    if (args.latency is None) != (args.bandwidth is None):
        parser.error("--latency and --bandwidth go together (or neither: a launch measures them)")
    if args.latency is not None and (args.latency < 0 or not args.bandwidth > 0):
        parser.error(
            f"--latency must be >= 0 and --bandwidth > 0, got {args.latency:g} and {args.bandwidth:g}"
        )
    if args.ranks < 2:
        parser.error(f"tune EXAMPLE plans a pipeline: --ranks must be at least 2, got {args.ranks}")
    pp = args.ranks
    batch = args.batch or 4 * pp
    timeout_s = peer_timeout(args, parser)
    options: dict = {}
    if args.tower_ratio is not None:
        from graph_exec.cli.tower_sweep import calibrate as sweep_calibrate

        # R in chunks of 2P stages, as `bench qwen2vl --tower-ratio` with its default V = 2
        startup = sweep_calibrate(args.size, 2 * pp, batch // pp, args.device, args.pin_cores, args.timeout)
        try:
            options["vision_depth"] = startup.depth_for(args.tower_ratio)
        except ValueError as exc:
            print(f"graph-exec tune: error: {exc}", file=sys.stderr)
            return 2
        print(f"R={args.tower_ratio:g}: {options['vision_depth']} vision blocks", flush=True)
    print(f"tune {args.example} ({args.size}), P={pp} batch {batch}: calibrating", flush=True)
    costs = _calibrate(args, batch // pp, options)
    try:
        if args.latency is None:
            costs = _in_pipeline(args, pp, batch, options, timeout_s, costs)
        else:
            costs = replace(costs, latency=args.latency, bandwidth=args.bandwidth)
    except JobFailed as failed:
        return failed.code
    path = args.save_costs or Path(f"{args.example}-costs.json")
    path.write_text(json.dumps(asdict(costs), indent=1) + "\n", encoding="utf-8")
    print(f"cost file written to {path} (edit it and rerun with --costs {path} --batch {batch})")
    splits = ("even", "rebalanced") if args.example in SPLITTABLE else ("even",)
    try:
        results = tune(costs, pp, batch, args.memory_budget, args.vpp, args.micro, splits)
    except (CostFileError, NoPlanFitsError, ValueError) as exc:
        print(f"graph-exec tune: error: {exc}", file=sys.stderr)
        return 2
    budget = "any memory" if args.memory_budget is None else f"{args.memory_budget / 2**20:.1f} MiB per rank"
    print(f"{len(results)} plans fit {budget}; the best {min(args.top, len(results))} (step in seconds):")
    sys.stdout.write(table(results, args.top))
    if not args.verify:
        return 0
    try:
        checked = to_verify(results)
        measured = verify(args, checked, pp, batch, costs, options, timeout_s)
    except JobFailed as failed:
        return failed.code
    sys.stdout.write(verify_table(checked, *measured))
    return 0


def _calibrate(args: argparse.Namespace, rows: int, options: dict) -> ModelCosts:
    """The example's costs, measured in a process of its own (bound to one core where ranks are)."""
    import subprocess

    from graph_exec.device import DevicePolicy
    from graph_exec.harness.model_costs import RESULT

    pin = args.pin_cores and DevicePolicy.for_target(args.device).pin_cores
    command = [
        sys.executable,
        "-m",
        "graph_exec.harness.model_costs",
        args.example,
        args.size,
        str(rows),
        "0",
        args.device,
        json.dumps(options),
        *(["pin"] if pin else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return ModelCosts.from_mapping(json.loads(line[len(RESULT) :]))
    raise SystemExit(
        f"graph-exec tune: the calibration failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    )


def _job(
    args: argparse.Namespace,
    pp: int,
    vpp: int,
    micro: int,
    batch: int,
    runs: tuple[RunSpec, ...],
    options: dict,
    timeout_s: float,
    *,
    calibrate: bool = False,
    steps: int | None = None,
    warmup: int | None = None,
) -> JobSpec:
    return JobSpec(
        example=args.example,
        size=args.size,
        ranks=pp,
        vpp=vpp,
        micro=micro,
        batch=batch,
        steps=steps or args.steps,
        warmup=warmup or args.warmup,
        runs=runs,
        timeout_s=timeout_s,
        calibrate=calibrate,
        pin_cores=args.pin_cores,
        verbose=args.verbose,
        device=args.device,
        model_options=options or None,
    )


def _in_pipeline(
    args: argparse.Namespace, pp: int, batch: int, options: dict, timeout_s: float, costs: ModelCosts
) -> ModelCosts:
    """``costs`` with its times measured where they matter: in short launches of the fair
    baseline (``V = 2``, so that stages 1..2P-2 are decoder layers only) at every micro-batch
    count the search tries, and one at ``V = 1`` beside the first (stages of more layers each:
    what tells a layer's cost from a stage call's fixed part,
    :func:`graph_exec.report.stage_fit.fit_stages`). Each run's per-op costs are as the bench
    measures them (:func:`graph_exec.report.predict.measured_costs`). The sizes give each
    micro-batch size's compute scale and the share of compute that does not grow with the
    rows; what the measured step exceeds the simulation of its own measured costs by, per
    compute step of a rank, is the runtime's own time per step. Transfer latency and bandwidth
    come from the first launch. With a trainable preprocess that launch also runs MPipe, whose
    recompute-backward (forward and backward in one call) costs less than the baseline's two
    apart."""
    trainable = costs.preprocess == "trainable"
    spec = RunSpec(name="calibration.graph", baseline=True, trainable=trainable)
    mpipe = RunSpec(name="calibration_mpipe.graph", baseline=False, trainable=True)
    micros = searched_micros(pp, batch, args.micro)
    plan = [(2, micro) for micro in micros] + [(1, micros[0])]
    measured, recompute = [], None
    for vpp, micro in plan:
        runs = (spec, mpipe) if trainable and not measured else (spec,)
        job = _job(args, pp, vpp, micro, batch, runs, options, timeout_s, calibrate=True, steps=12, warmup=2)
        print(
            f"measuring in the pipeline: the fair baseline, V={vpp} M={micro}, {job.total_steps} steps",
            flush=True,
        )
        where = None if args.log_dir is None else args.log_dir / f"calibration_V{vpp}_M{micro}"
        with run_directory(where) as run_dir:
            execute(job, run_dir, args.timeout, lambda line: None, "graph-exec tune")
            launch, measured_recompute = read_launch(job, run_dir, costs.layers)
        measured.append(launch)
        recompute = recompute if measured_recompute is None else measured_recompute
    return from_launches(costs, batch, measured, recompute)


def read_launch(job: JobSpec, run_dir: Path, layers: int, run: int = 0) -> tuple[Launch, float | None]:
    """The :class:`Launch` of ``job``'s run number ``run`` (the fair baseline, even split) from
    its records in ``run_dir``, and the recompute an MPipe run beside it measured (``None``:
    none ran)."""
    from graph_exec.balance import even_layers
    from graph_exec.report.bench_report import evaluate

    results = evaluate(job, run_dir)
    result = results[run]
    stages = job.pp * job.vpp
    launch = Launch(
        job.micro,
        result.prediction.costs,
        result.summary.step_time,
        result.prediction.step_time,
        job.vpp,
        even_layers(max(layers, stages), stages),
    )
    mpipe = [r for spec, r in zip(job.runs, results, strict=True) if not spec.baseline]
    return launch, mpipe[0].prediction.costs.recompute if mpipe else None


def searched_micros(pp: int, batch: int, micros: Sequence[int] | None) -> list[int]:
    """The micro-batch counts the search tries (as :func:`graph_exec.tune.candidates`), fewest
    (the largest micro-batch) first."""
    return sorted({m for m in (micros or range(pp, batch + 1)) if m >= 1 and batch % m == 0})


@dataclass(frozen=True)
class Launch:
    """One calibration launch of the fair baseline: its ``M``, its per-op costs as measured, its
    measured median step, the simulation of its own measured costs, its ``V`` and its split."""

    micro: int
    costs: OpCosts
    step: float
    simulated: float
    vpp: int
    layers: tuple[int, ...]


def from_launches(
    costs: ModelCosts,
    batch: int,
    launches: Sequence[Launch],
    recompute: float | None = None,
) -> ModelCosts:
    """``costs`` with the times of ``launches`` (see :func:`_in_pipeline`): the first at the
    largest micro-batch; those of its ``V`` at smaller micro-batches give the compute scale;
    those at its micro-batch, of any ``V``, give the per-layer and per-call costs. For a
    trainable preprocess, ``recompute`` is the one measured in an MPipe run at the first
    launch's micro-batch (``None``: not measured, priced as its forward plus backward)."""
    from graph_exec.report.stage_fit import MeasuredSplit, fit_stages

    big = launches[0]
    fit = fit_stages([MeasuredSplit(x.costs, x.layers) for x in launches if x.micro == big.micro])
    trained = costs.preprocess == "trainable"

    def compute(c: OpCosts) -> float:  # one micro-batch's compute on every stage and the preprocess
        stages = range(len(big.layers))
        return (
            sum(c.forward_at(s) + c.backward_at(s) for s in stages)
            + c.preprocess_forward
            + (c.preprocess_backward if trained else 0.0)
        )

    def overhead(launch: Launch) -> float:
        steps = launch.micro * (2 * launch.vpp + 1 + trained)  # rank 0: F and B of its chunks, the preprocess
        return max(launch.step - launch.simulated, 0.0) / steps

    # each smaller micro-batch of the first launch's split: its rows and its compute over the first's
    rest = [x for x in launches[1:] if x.layers == big.layers]
    points = tuple((big.micro / x.micro, compute(x.costs) / compute(big.costs)) for x in rest)
    fixed = 0.0
    if points:
        k, scale = min(points)  # the smallest micro-batch: the fixed share's line through it
        fixed = min(max((scale - k) / (1 - k), 0.0), 1.0)
    return replace(
        costs,
        micro_batch_size=batch // big.micro,
        layer_forward=fit.layer_forward,
        layer_backward=fit.layer_backward,
        chunk_forward=fit.chunk_forward,
        chunk_backward=fit.chunk_backward,
        first_stage_forward=fit.first_forward,
        first_stage_backward=fit.first_backward,
        last_stage_forward=fit.last_extra,
        preprocess_forward=big.costs.preprocess_forward,
        preprocess_backward=big.costs.preprocess_backward if trained else 0.0,
        preprocess_recompute=recompute if trained else None,
        latency=big.costs.latency,
        bandwidth=big.costs.bandwidth,
        fixed_share=fixed,
        scale_points=points,
        op_overhead=statistics.fmean(overhead(launch) for launch in launches),
    )


def run_spec(index: int, predicted: Predicted, trainable: bool) -> RunSpec:
    """The bench harness's run of a candidate."""
    c = predicted.candidate
    return RunSpec(
        name=f"candidate{index}.graph",
        baseline=c.schedule == "baseline",
        trainable=trainable,
        run_ahead=c.run_ahead,
        backward=c.backward,
        recompute=c.recompute,
        layers=predicted.layers if c.split == "rebalanced" else None,
    )


def verify(
    args: argparse.Namespace,
    best: list[Predicted],
    pp: int,
    batch: int,
    costs: ModelCosts,
    options: dict,
    timeout_s: float,
) -> tuple[list[float], list[OpCosts]]:
    """The measured median step of each of ``best`` (seconds), one launch per ``(V, M)``, and
    its per-step costs as measured (:func:`graph_exec.report.predict.measured_costs`)."""
    from graph_exec.report.bench_report import evaluate

    trainable = costs.preprocess == "trainable"
    groups: dict[tuple[int, int], list[int]] = {}
    for k, p in enumerate(best):
        groups.setdefault((p.candidate.vpp, p.candidate.micro), []).append(k)
    measured = [math.nan] * len(best)
    measured_ops: list[OpCosts] = [OpCosts()] * len(best)
    for (vpp, micro), members in groups.items():
        runs = tuple(run_spec(k + 1, best[k], trainable) for k in members)
        job = _job(args, pp, vpp, micro, batch, runs, options, timeout_s)
        print(
            f"verifying {', '.join(f'#{k + 1}' for k in members)} (V={vpp} M={micro}): "
            f"{len(runs)} runs x {job.total_steps} steps",
            flush=True,
        )
        where = None if args.log_dir is None else args.log_dir / f"verify_V{vpp}_M{micro}"
        with run_directory(where) as run_dir:
            execute(job, run_dir, args.timeout, lambda line: None, "graph-exec tune")
            for k, result in zip(members, evaluate(job, run_dir), strict=True):
                measured[k] = result.summary.step_time
                measured_ops[k] = result.prediction.costs
    return measured, measured_ops


def _family(p: Predicted) -> str:
    return f"{p.candidate.schedule} split={p.candidate.split}"


def to_verify(results: Sequence[Predicted]) -> list[Predicted]:
    """The best :data:`VERIFIED` and, after them, the best of every other family (MPipe, the
    fair and the rebalanced baseline) that fits: so that whether the choice of schedule was
    right is measured, not only the order of the top three."""
    chosen = list(results[:VERIFIED])
    seen = {_family(p) for p in chosen}
    for p in results[VERIFIED:]:
        if _family(p) not in seen:
            seen.add(_family(p))
            chosen.append(p)
    return chosen


def verify_table(
    best: list[Predicted], measured: list[float], measured_ops: list[OpCosts] | None = None
) -> str:
    """Predicted against measured for each verified candidate, and the verdicts: is the choice
    within :data:`WITHIN` of the fastest, and did the search pick MPipe exactly where MPipe's
    best measured faster than every baseline's best. With ``measured_ops``, each line also
    says how the compute of its steps measured against the calibrated costs (``compute``): a
    step off by as much as its compute was mispriced per step (or ran on a machine whose speed
    changed since the calibration), not mis-scheduled. Where MPipe's best and the baselines'
    best measured within :data:`WITHIN` of each other the verdict says it is a tie: either
    choice is then within the tolerance the first verdict grants, and which one measured faster
    is the launch's noise."""
    lines = ["", "verified (ms):"]
    for k, (p, m) in enumerate(zip(best, measured, strict=True), 1):
        compute = ""
        if measured_ops is not None and p.op_costs is not None and p.compute_time() > 0:
            compute = f"  compute {p.compute_time(measured_ops[k - 1], 0.0) / p.compute_time():.3f}"
        lines.append(
            f"{k:2d}. {p.candidate.describe():<62} predicted {p.step_time * 1e3:8.2f}  measured "
            f"{m * 1e3:8.2f}  measured/predicted {m / p.step_time:.3f}{compute}"
        )
    fastest = min(range(len(best)), key=lambda k: measured[k])
    ratio = measured[0] / measured[fastest]
    lines.append(f"fastest measured: #{fastest + 1} {best[fastest].candidate.describe()}")
    verdict = "within" if ratio <= WITHIN else "NOT within"
    lines.append(f"chosen #1 is {ratio:.3f}x the fastest verified: {verdict} {WITHIN:g}x")
    family_best: dict[str, float] = {}
    for p, m in zip(best, measured, strict=True):
        family_best[_family(p)] = min(m, family_best.get(_family(p), math.inf))
    baselines = {f: m for f, m in family_best.items() if not f.startswith("mpipe")}
    mpipe = family_best.get("mpipe split=even")
    if mpipe is not None and baselines:
        fastest_baseline = min(baselines, key=baselines.__getitem__)
        faster = mpipe < baselines[fastest_baseline]
        chose_mpipe = best[0].candidate.schedule == "mpipe"
        apart = max(mpipe, baselines[fastest_baseline]) / min(mpipe, baselines[fastest_baseline])
        tie = f" (a tie: {apart:.3f}x apart, within {WITHIN:g}x)" if apart <= WITHIN else ""
        lines.append(
            f"MPipe {'faster' if faster else 'not faster'} than the best baseline ({fastest_baseline}: "
            f"{mpipe * 1e3:.2f} against {baselines[fastest_baseline] * 1e3:.2f} ms); the search chose "
            f"{best[0].candidate.schedule}: {'agrees' if faster == chose_mpipe else 'DISAGREES'}{tie}"
        )
    return "\n".join(lines) + "\n"
