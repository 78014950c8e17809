"""``graph-exec simulate``: the cost-model timeline of a plan (see :mod:`graph_exec.simulate`)."""

from __future__ import annotations

import argparse
import json
import sys

from graph_exec.cli.argtypes import (
    finite_non_negative,
    non_negative_int,
    number,
    positive_number,
    tower_weights,
)
from graph_exec.cli.plan import add_plan_arguments, build_or_report, config_from_args
from graph_exec.schedule.memory import ItemSizes, peak_bytes, peak_counts
from graph_exec.schedule.placement import TOWER_ORDERS
from graph_exec.schedule.plan import Plan
from graph_exec.schedule.size import SIMULATE_BYTES_PER_STEP
from graph_exec.simulate import OpCosts, SimResult, simulate, to_chrome_trace

#: ``--tower-order arrival,balanced``: one or more of the orders, each simulated.
_tower_orders = number(
    lambda text: tuple(text.split(",")),
    lambda v: len(set(v)) == len(v) and all(o in TOWER_ORDERS for o in v),
    f"one or more of {', '.join(TOWER_ORDERS)}, comma-separated, none twice",
)

#: ``--held-bytes B[,B...]``: bytes one micro-batch's forward keeps per stage (one: every stage).
_held_bytes = number(
    lambda text: tuple(int(part) for part in text.split(",")),
    lambda v: all(b >= 0 for b in v),
    "bytes >= 0 (integers), one for every stage or one per stage, comma-separated",
)

#: flag -> (OpCosts field, argparse type, help)
_COST_FLAGS = {
    "--fwd-time": ("forward", finite_non_negative, "one F step (one chunk, one micro-batch)"),
    "--bwd-time": ("backward", finite_non_negative, "one B step"),
    "--i-time": (
        "input_backward",
        finite_non_negative,
        "one I step of --body zb (input gradient; default: half of --bwd-time)",
    ),
    "--w-time": (
        "weight_backward",
        finite_non_negative,
        "one W step of --body zb (weight gradients; default: half of --bwd-time)",
    ),
    "--pre-fwd-time": ("preprocess_forward", finite_non_negative, "Pf: one preprocess forward (TFWD)"),
    "--recompute-time": ("recompute", finite_non_negative, "R: one TBWD (or the compute of GRADrecv+bwd)"),
    "--pre-bwd-time": (
        "preprocess_backward",
        finite_non_negative,
        "one TBWD of the fair baseline (no transposition: backward from the tape, no recompute)",
    ),
    "--bcast-time": ("broadcast", finite_non_negative, "one BCAST of the trainable preprocess weights"),
    "--reduce-time": ("allreduce", finite_non_negative, "one GRADreduce"),
    "--latency": ("latency", finite_non_negative, "per transfer"),
    "--bandwidth": ("bandwidth", positive_number, "bytes per time unit"),
    "--act-bytes": ("activation_bytes", finite_non_negative, "bytes per body transfer"),
    "--pre-bytes": ("preprocess_bytes", finite_non_negative, "bytes per OUT/IN/GRAD transfer"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a plan under a cost model",
        description=(
            "List-scheduling simulation of a plan: step time, busy/idle per rank, bubble fraction "
            "and, for MPipe plans, the fair baseline (the same plan without transposition) and the saving."
        ),
    )
    add_plan_arguments(parser)
    group = parser.add_argument_group("costs (any time unit; the trace reads it as ms)")
    defaults = OpCosts()
    for flag, (name, kind, text) in _COST_FLAGS.items():
        default = getattr(defaults, name)
        # dest prefixed: "backward" is already the plan's --backward {central,owner}
        group.add_argument(
            flag,
            dest=f"cost_{name}",
            metavar="X",
            type=kind,
            default=default,
            help=text if default is None else f"{text} (default {default:g})",
        )
    group.add_argument(
        "--fused-last-stage",
        action="store_true",
        help="the last stage runs forward+loss+backward at F (as the runtime does) instead of F then B",
    )
    group.add_argument(
        "--tower-costs",
        metavar="W,W,...",
        type=tower_weights,
        help="each micro-batch's tower weight (e.g. its image patches), multiplying --pre-fwd-time, "
        "--recompute-time and --pre-bwd-time; one per micro-batch (default: every weight 1)",
    )
    group.add_argument(
        "--tower-order",
        metavar="ORDER[,ORDER]",
        type=_tower_orders,
        default=("arrival",),
        help="which user micro-batch runs as which plan micro: arrival (as given), balanced "
        "(cost-aware placement of the towers); several are simulated and compared (default arrival)",
    )
    memory = parser.add_argument_group(
        "memory (the predicted peak per rank: counts, and bytes with --held-bytes)"
    )
    memory.add_argument(
        "--held-bytes",
        metavar="B[,B...]",
        type=_held_bytes,
        help="bytes a forward keeps for its backward per micro-batch (the tape, or the input with "
        "recompute), one for every stage or one per stage; receives weigh --act-bytes and "
        "preprocess outputs --pre-bytes",
    )
    memory.add_argument(
        "--preprocess-tape-bytes",
        metavar="B",
        type=non_negative_int,
        default=0,
        help="bytes of one kept preprocess tape (--keep-preprocess-tape plans; default 0)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="write a chrome-trace JSON (one track per rank; of the first --tower-order)",
    )
    parser.set_defaults(func=lambda args: _run(args, parser))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = config_from_args(args, parser, SIMULATE_BYTES_PER_STEP, "simulating the plan")
    if args.tower_costs and len(args.tower_costs) != config.micro:
        parser.error(
            f"--tower-costs has {len(args.tower_costs)} values but --micro is {config.micro}: give one per micro-batch"
        )
    if args.tower_costs and args.cost_preprocess_forward == 0:
        parser.error(
            "--tower-costs weighs --pre-fwd-time (a weight-1 tower's forward), which is 0: give --pre-fwd-time"
        )
    costs = OpCosts(
        **{name: getattr(args, f"cost_{name}") for name, _, _ in _COST_FLAGS.values()},
        fused_last_stage=args.fused_last_stage,
        tower_costs=args.tower_costs or (),
    )
    held = args.held_bytes
    stages = config.pp * config.vpp
    if held is not None and len(held) not in (1, stages):
        parser.error(
            f"--held-bytes has {len(held)} values but the plan has {stages} stages: give one, or one per stage"
        )
    plan = build_or_report(config, parser.prog)
    if plan is None:
        return 1
    results = {order: simulate(plan, costs, order) for order in args.tower_order}
    several = len(results) > 1
    for order, result in results.items():
        if several:
            print(f"== tower order {order}")
        sys.stdout.write(report(result))
    if several:
        sys.stdout.write(comparison(results))
    sizes = None
    if held is not None:
        sizes = ItemSizes(
            activations={s: held[0] if len(held) == 1 else held[s] for s in range(stages)},
            stage_inputs=dict.fromkeys(range(stages), int(costs.activation_bytes)),
            preprocess_output=int(costs.preprocess_bytes),
            preprocess_tape=args.preprocess_tape_bytes,
        )
    sys.stdout.write(memory_report(plan, sizes))
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as out:
            json.dump(to_chrome_trace(next(iter(results.values()))), out)
        print(f"trace written to {args.trace}")
    return 0


def comparison(results: dict[str, SimResult]) -> str:
    """One line per order after the first: its step time against the first order's."""
    (first, reference), *others = results.items()
    lines = []
    for order, result in others:
        speedup = reference.step_time / result.step_time if result.step_time else 1.0
        lines.append(
            f"{order} vs {first}: step time {result.step_time:.6g} vs {reference.step_time:.6g} "
            f"({speedup:.3f}x)"
        )
    return "\n".join(lines) + "\n"


def memory_report(plan: Plan, sizes: ItemSizes | None) -> str:
    """Each rank's predicted peak: the most items of each kind it holds at once (each kind's
    own peak) and, with ``sizes``, the peak of the bytes of every kind together."""
    lines = ["predicted peak held per rank (items at once; bytes: the peak of their sum):"]
    for rank in range(plan.config.pp):
        counts = ", ".join(f"{kind} {n}" for kind, n in peak_counts(plan, rank).items() if n)
        line = f"rank {rank}: {counts or 'nothing'}"
        if sizes is not None:
            line += f"; {peak_bytes(plan, rank, sizes)} bytes"
        lines.append(line)
    return "\n".join(lines) + "\n"


def report(result: SimResult) -> str:
    """The printed summary."""
    lines = [f"step time: {result.step_time:.6g}", f"bubble fraction: {result.bubble_fraction:.4f}"]
    if result.order and list(result.order) != sorted(result.order):
        lines.append(f"tower placement (user micro-batch per plan micro): {','.join(map(str, result.order))}")
    for rank, (busy, idle) in enumerate(zip(result.busy, result.idle, strict=True)):
        lines.append(f"rank {rank}: busy {busy:.6g} idle {idle:.6g}")
    if result.baseline is not None:
        saving = result.saving or 0.0
        share = saving / result.baseline.step_time if result.baseline.step_time else 0.0
        lines.append(f"fair baseline (no transposition): step time {result.baseline.step_time:.6g}")
        lines.append(f"MPipe saving: {saving:.6g} ({share:.1%} of the fair baseline's step)")
    return "\n".join(lines) + "\n"
