"""``graph-exec tune``: the plans that fit a memory budget, fastest first, from measured costs.

``--costs FILE`` is pure Python (no MindSpore): the costs are a JSON object of
:class:`graph_exec.tune.ModelCosts`'s fields, measured once on one micro-batch; every candidate
is simulated and its per-rank peak predicted (:mod:`graph_exec.tune`). ``tune EXAMPLE``
calibrates a built-in example first and writes its cost file (:mod:`graph_exec.cli.tune_example`);
``--verify`` then runs the best three and prints predicted against measured. ``--config
DIR/config.json`` prices a real-size Llama, Qwen2 or Qwen2-VL from its config alone, memory
only (:mod:`graph_exec.cli.tune_config`, docs/memory.md).
"""

from __future__ import annotations

import argparse
import re
import sys

from graph_exec.cli.argtypes import number, positive_int
from graph_exec.tune import CostFileError, ModelCosts, NoPlanFitsError, table, tune

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _bytes(text: str) -> int | None:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


#: ``--memory-budget 64GiB`` (or bytes, KB/MB/GB, KiB/MiB/GiB).
memory_size = number(
    _bytes, lambda v: v is not None and v > 0, "a size > 0: bytes, or with KB/MB/GB/KiB/MiB/GiB"
)
#: ``--vpp 1,2,4`` and ``--micro 4,8``.
int_list = number(
    lambda text: tuple(int(p) for p in text.split(",")),
    lambda v: len(v) >= 1 and all(x >= 1 for x in v),
    "comma-separated integers >= 1 (e.g. 1,2,4)",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="the plans that fit a memory budget, fastest first, from measured costs",
        description=__doc__.split("\n\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "example",
        nargs="?",
        metavar="EXAMPLE",
        help="a built-in example to calibrate by measurement (one of: "
        + ", ".join(_example_names())
        + "); or pass --costs",
    )
    parser.add_argument(
        "--costs", metavar="FILE", help="JSON cost file (graph_exec.tune.ModelCosts), instead of EXAMPLE"
    )
    parser.add_argument("--ranks", metavar="P", type=positive_int, default=2, help="pipeline ranks")
    parser.add_argument(
        "--batch",
        metavar="B",
        type=positive_int,
        help="global batch, rows per step (per replica; required with --costs; EXAMPLE: 4 x P; --config: 2 x P)",
    )
    parser.add_argument(
        "--memory-budget", metavar="SIZE", type=memory_size, help="bytes per rank (default: any)"
    )
    parser.add_argument(
        "--vpp", metavar="V,...", type=int_list, default=(1, 2, 4), help="chunks per rank to try"
    )
    parser.add_argument(
        "--micro",
        metavar="M,...",
        type=int_list,
        help="micro-batch counts to try (default: every divisor of B >= P)",
    )
    parser.add_argument("--top", metavar="N", type=positive_int, default=10, help="candidates to print")
    parser.add_argument(
        "--dp", metavar="D", type=positive_int, default=1, help="data-parallel replicas of the pipeline"
    )
    parser.add_argument(
        "--zero",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: ZeRO-1, each replica keeps the optimizer state of 1/D of the parameters (needs D >= 2)",
    )
    from graph_exec.cli import tune_config, tune_example

    tune_config.add_arguments(parser)
    tune_example.add_arguments(parser)
    parser.set_defaults(func=lambda args: _run(args, parser))


def _example_names() -> tuple[str, ...]:
    from graph_exec.examples import EXAMPLES

    return tuple(EXAMPLES)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sources = [args.example, args.costs, args.config]
    if sum(source is not None for source in sources) != 1:
        parser.error(
            "pass one of EXAMPLE (calibrated by measurement), --costs FILE or --config PATH (a real model's config)"
        )
    if args.zero and args.dp < 2:
        parser.error(
            f"--zero 1 shards the optimizer state over the data-parallel replicas: it needs --dp >= 2, got --dp {args.dp}"
        )
    if args.config is not None:
        from graph_exec.cli import tune_config

        return tune_config.run(args)
    if args.example is not None:
        if args.dp != 1 or args.zero:
            parser.error("--dp and --zero apply to --costs and --config; EXAMPLE measures one pipeline")
        from graph_exec.cli import tune_example

        return tune_example.run(args, parser)
    if args.batch is None:
        parser.error("--costs needs --batch B (the global batch, rows per step)")
    try:
        costs = ModelCosts.load(args.costs)
        results = tune(
            costs,
            args.ranks,
            args.batch,
            args.memory_budget,
            args.vpp,
            args.micro,
            dp=args.dp,
            zero=bool(args.zero),
        )
    except (CostFileError, NoPlanFitsError, ValueError) as exc:
        print(f"graph-exec tune: error: {exc}", file=sys.stderr)
        return 2
    budget = "any memory" if args.memory_budget is None else f"{args.memory_budget / 2**20:.1f} MiB per rank"
    print(f"{len(results)} plans fit {budget}; the best {min(args.top, len(results))}:")
    sys.stdout.write(table(results, args.top))
    return 0
