"""``graph-exec tune --config DIR/config.json``: which plans of a real-size model fit a budget.

Pure Python (:mod:`graph_exec.config_sizes`): the model's parameters counted from its config as
:func:`graph_exec.models.split_model` would place them, the tape per layer from the calibrated
formula, and every candidate plan's per-rank peak from the plan's memory model. A real model's
step time is not predicted: it needs costs measured at its size, which a CPU here cannot give,
so the plans are listed by their largest per-rank peak, smallest first.
"""

from __future__ import annotations

import argparse
import sys

from graph_exec.cli.argtypes import non_negative_int, positive_int
from graph_exec.config_sizes import (
    DTYPE_BYTES,
    ConfigError,
    ModelShape,
    Workload,
    config_costs,
    model_shape,
    param_counts,
    read_config,
)
from graph_exec.tune import PARTS, NoPlanFitsError, Predicted, tune

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a real model from its config (--config)")
    group.add_argument(
        "--config", metavar="PATH", help="a Llama, Qwen2 or Qwen2-VL config.json (or its directory)"
    )
    group.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        help="parameters' dtype (default: the config's torch_dtype, else float32); not float32: "
        "a float32 master copy joins Adam's state",
    )
    group.add_argument("--seq-len", metavar="S", type=positive_int, default=4096, help="tokens per row")
    group.add_argument(
        "--image-tokens",
        metavar="N",
        type=non_negative_int,
        default=1024,
        help="Qwen2-VL: tokens per row from the vision tower (part of --seq-len)",
    )
    group.add_argument(
        "--attention",
        choices=("eager", "flash"),
        default="eager",
        help="eager keeps every layer's heads x S x S attention probabilities for the backward; flash does not",
    )


def run(args: argparse.Namespace) -> int:
    """Print the plans that fit, each with its per-rank peak and where the largest goes."""
    try:
        config = read_config(args.config)
        shape = model_shape(config)
        dtype = args.dtype or _config_dtype(config)
        work = Workload(args.seq_len, args.image_tokens if shape.vision else 0, dtype, args.attention)
        costs = config_costs(shape, work)
        batch = args.batch or 2 * args.ranks
        results = tune(
            costs,
            args.ranks,
            batch,
            args.memory_budget,
            args.vpp,
            args.micro,
            ("even",),
            dp=args.dp,
            zero=bool(args.zero),
        )
    except (ConfigError, NoPlanFitsError, ValueError) as exc:
        print(f"graph-exec tune: error: {exc}", file=sys.stderr)
        return 2
    print(describe(shape, work, args.ranks, args.dp, bool(args.zero), batch))
    budget = "any memory" if args.memory_budget is None else f"{args.memory_budget / GIB:.1f} GiB per rank"
    print(f"{len(results)} plans fit {budget}; the {min(args.top, len(results))} smallest peaks:")
    sys.stdout.write(plan_table(results, args.top))
    print(hand_check(shape, work, results[0], args.ranks, args.dp, bool(args.zero)))
    print("step time: out of reach for a real model here (it needs costs measured at its size); not guessed")
    return 0


def _config_dtype(config: dict) -> str:
    value = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return value if value in DTYPE_BYTES else "float32"


def describe(shape: ModelShape, work: Workload, pp: int, dp: int, zero: bool, batch: int) -> str:
    counts = param_counts(shape)
    vision = f", vision tower {counts.vision:,}" if shape.vision else ""
    return (
        f"{shape.family}: {counts.total:,} parameters ({shape.layers} layers of {counts.layer:,}"
        f"{vision}); {work.dtype}, {work.attention} attention, {work.seq} tokens per row"
        + (f" ({work.image_tokens} from images)" if shape.vision else "")
        + f"; P={pp}, D={dp}, ZeRO-1 {'on' if zero else 'off'}, {batch} rows per step per replica"
    )


def plan_table(results: list[Predicted], top: int) -> str:
    """One line per plan: its largest per-rank peak, every rank's, and the largest's split."""
    lines = []
    for k, p in enumerate(results[:top], 1):
        rank = max(range(len(p.peak_bytes)), key=p.peak_bytes.__getitem__)
        peaks = " ".join(f"{b / GIB:.1f}" for b in p.peak_bytes)
        split = ", ".join(f"{name} {p.parts[rank][name] / GIB:.2f}" for name in PARTS if p.parts[rank][name])
        lines.append(
            f"{k:2d}. {p.candidate.describe():<50} peak GiB/rank {peaks}\n"
            f"    rank {rank} ({p.peak_bytes[rank] / GIB:.2f} GiB): {split}"
        )
    return "\n".join(lines) + "\n"


def hand_check(shape: ModelShape, work: Workload, best: Predicted, pp: int, dp: int, zero: bool) -> str:
    """The best plan's rank 0 parameter and optimizer bytes, written out as a reader checks them."""
    counts = param_counts(shape)
    e, master = DTYPE_BYTES[work.dtype], 0 if work.dtype == "float32" else 4
    layers = sum(n for s, n in enumerate(best.layers) if s % pp == 0)
    terms = [f"{layers} layers x {counts.layer + counts.layer_buffers:,}"]
    own = layers * (counts.layer + counts.layer_buffers)
    if (len(best.layers) - 1) % pp == 0:
        terms.append(f"norm and head {counts.final:,}")
        own += counts.final
    if shape.vision:
        terms.append(f"embedding {counts.embedding + counts.unplaced:,}")
        own += counts.embedding + counts.unplaced
    preprocess = counts.vision if shape.vision else counts.embedding
    terms.append(f"{'frozen vision tower' if shape.vision else 'embedding'} {preprocess:,}")
    trained = own if shape.vision else own + preprocess
    shards = dp if zero else 1
    optimizer = -(-trained * (8 + master) // shards)
    return (
        f"hand check, plan 1, rank 0: parameters {' + '.join(terms)} = {own + preprocess:,} x {e} B"
        f" = {(own + preprocess) * e:,} B (table: {best.parts[0]['parameters']:,});"
        f" optimizer {trained:,} trained x ({master} master + 8 Adam) B / {shards} = {optimizer:,} B"
        f" (table: {best.parts[0]['optimizer']:,})"
    )
