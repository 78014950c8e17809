"""``graph-exec simulate``: the cost-model timeline of a plan (see :mod:`graph_exec.simulate`)."""

from __future__ import annotations

import argparse
import json
import sys

from graph_exec.cli.argtypes import finite_non_negative, positive_number
from graph_exec.cli.plan import add_plan_arguments, build_or_report, config_from_args
from graph_exec.schedule.size import SIMULATE_BYTES_PER_STEP
from graph_exec.simulate import OpCosts, SimResult, simulate, to_chrome_trace

#: flag -> (OpCosts field, argparse type, help)
_COST_FLAGS = {
    "--fwd-time": ("forward", finite_non_negative, "one F step (one chunk, one micro-batch)"),
    "--bwd-time": ("backward", finite_non_negative, "one B step"),
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
            help=f"{text} (default {default:g})",
        )
    group.add_argument(
        "--fused-last-stage",
        action="store_true",
        help="the last stage runs forward+loss+backward at F (as the runtime does) instead of F then B",
    )
    parser.add_argument("--trace", metavar="FILE", help="write a chrome-trace JSON (one track per rank)")
    parser.set_defaults(func=lambda args: _run(args, parser))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = config_from_args(args, parser, SIMULATE_BYTES_PER_STEP, "simulating the plan")
    costs = OpCosts(
        **{name: getattr(args, f"cost_{name}") for name, _, _ in _COST_FLAGS.values()},
        fused_last_stage=args.fused_last_stage,
    )
    plan = build_or_report(config, parser.prog)
    if plan is None:
        return 1
    result = simulate(plan, costs)
    sys.stdout.write(report(result))
    if args.trace:
        with open(args.trace, "w", encoding="utf-8") as out:
            json.dump(to_chrome_trace(result), out)
        print(f"trace written to {args.trace}")
    return 0


def report(result: SimResult) -> str:
    """The printed summary."""
    lines = [f"step time: {result.step_time:.6g}", f"bubble fraction: {result.bubble_fraction:.4f}"]
    for rank, (busy, idle) in enumerate(zip(result.busy, result.idle, strict=True)):
        lines.append(f"rank {rank}: busy {busy:.6g} idle {idle:.6g}")
    if result.baseline is not None:
        saving = result.saving or 0.0
        share = saving / result.baseline.step_time if result.baseline.step_time else 0.0
        lines.append(f"fair baseline (no transposition): step time {result.baseline.step_time:.6g}")
        lines.append(f"MPipe saving: {saving:.6g} ({share:.1%} of the fair baseline's step)")
    return "\n".join(lines) + "\n"
