"""``graph-exec plan``: print the per-rank orders of one configuration.

Also home of the plan flags shared with ``graph-exec simulate``, so both commands accept and
reject exactly the same configurations with the same messages.
"""

from __future__ import annotations

import argparse
import sys

from graph_exec.cli.argtypes import non_negative_int, positive_int
from graph_exec.schedule import (
    Plan,
    PlanConfig,
    PlanConfigError,
    ScheduleError,
    build_plan,
    check_plan_size,
    to_csv,
    to_text,
    write_json,
)
from graph_exec.schedule.config import BACKWARD, BODY, PREPROCESS, RUN_AHEAD
from graph_exec.schedule.size import BUILD_BYTES_PER_STEP, MAX_PLAN_STEPS


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that describe a plan."""
    defaults = PlanConfig(pp=1)  # the flags default to what the Python API defaults to
    group = parser.add_argument_group("plan")
    group.add_argument("--pp", metavar="P", type=positive_int, required=True, help="pipeline ranks")
    group.add_argument(
        "--vpp", metavar="V", type=positive_int, default=defaults.vpp, help="model chunks per rank"
    )
    group.add_argument(
        "--micro",
        metavar="M",
        type=positive_int,
        help=f"micro-batches per step (default: P, one round of micro-batches; a plan estimated above "
        f"{MAX_PLAN_STEPS:,} steps, or a quarter of this machine's memory, is refused before it is built)",
    )
    group.add_argument(
        "--preprocess",
        choices=PREPROCESS,
        default=defaults.preprocess,
        help="trainable (weights broadcast, TBWD), frozen (outputs only) or none (dataload only)",
    )
    group.add_argument(
        "-T",
        "--num-preprocess-layers",
        metavar="T",
        type=non_negative_int,
        help="leading layers of stage 0 in the preprocess (default: 1, or 0 for --preprocess none)",
    )
    group.add_argument(
        "--run-ahead",
        "--overflow",
        dest="run_ahead",
        choices=RUN_AHEAD,
        default=defaults.run_ahead,
        help="how far the transposed preprocess runs ahead: micros beyond NT=min(P,M) spread over the "
        "owners (full) or inline on rank 0 (min); --overflow is its old name",
    )
    group.add_argument(
        "--backward",
        choices=BACKWARD,
        default=defaults.backward,
        help="preprocess gradient on rank 0 (central) or on each owner + all-reduce (owner)",
    )
    group.add_argument(
        "--owned-input",
        action="store_true",
        help="each micro's raw input lives on its owner only (ships it to rank 0 for central backward)",
    )
    group.add_argument("--body", choices=BODY, default=defaults.body, help="body schedule")
    group.add_argument(
        "--no-transpose",
        dest="transpose",
        action="store_false",
        help="the fair baseline: rank 0 runs every preprocess right before F 0.m (and its backward "
        "right after B 0.m); no broadcast, no transfers",
    )


def config_from_args(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    bytes_per_step: int = BUILD_BYTES_PER_STEP,
    what: str = "building the plan",
) -> PlanConfig:
    """The configuration the flags describe; an impossible one, or one whose plan would be too
    large for this machine (:mod:`graph_exec.schedule.size`, checked by formula before anything
    is built), exits like any argparse error."""
    try:
        config = PlanConfig(
            pp=args.pp,
            vpp=args.vpp,
            micro=args.micro,
            preprocess=args.preprocess,
            num_preprocess_layers=args.num_preprocess_layers,
            run_ahead=args.run_ahead,
            backward=args.backward,
            input="owned" if args.owned_input else "replicated",
            body=args.body,
            transpose=args.transpose,
        )
        check_plan_size(config, bytes_per_step, what)
    except PlanConfigError as err:
        parser.error(str(err))
    return config


def build_or_report(config: PlanConfig, prog: str) -> Plan | None:
    """``build_plan``, reporting a validation failure (a bug, not bad input) without a traceback."""
    try:
        return build_plan(config)
    except ScheduleError as err:
        print(f"{prog}: error: the plan failed validation (please report): {err}", file=sys.stderr)
        return None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="print the per-rank orders of a pipeline plan",
        description="Build, validate and print the per-rank orders of an MPipe Transpose plan.",
    )
    add_plan_arguments(parser)
    parser.add_argument("--format", choices=("text", "json", "csv"), default="text", help="output format")
    parser.add_argument("--with-idle", action="store_true", help="text format: show the idle slots as ·")
    parser.add_argument(
        "--json-steps",
        action="store_true",
        help="json format: also write every step as an object (kind, stage, micro, peer); "
        "tokens only by default",
    )
    parser.set_defaults(func=lambda args: _run(args, parser))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.with_idle and args.format != "text":
        parser.error(f"--with-idle applies to --format text only, got --format {args.format}")
    if args.json_steps and args.format != "json":
        parser.error(f"--json-steps applies to --format json only, got --format {args.format}")
    plan = build_or_report(config_from_args(args, parser), parser.prog)
    if plan is None:
        return 1
    if args.format == "json":
        write_json(plan, sys.stdout, steps=args.json_steps)
    elif args.format == "csv":
        sys.stdout.write(to_csv(plan))
    else:
        sys.stdout.write(to_text(plan, with_idle=args.with_idle))
    return 0
