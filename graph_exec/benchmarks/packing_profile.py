"""Where a packed token slot's time goes, against a padded one's: per component, in one process.

``packing_speed`` measures whole pipelined steps; this takes its model and its micro-batches
(the same ``--size``/``--hidden``/mix/batch/M/rows, built by ``packing_speed``'s own functions
for the steps of ``--steps``) and times, per micro-batch and way, each part of its forward and
backward in one process, no pipeline, the ways alternating rep by rep so that load hits both:

* ``tensors``: the inputs and labels made MindSpore tensors (inside ``packing_speed``'s timed step);
* ``tower``: the frozen vision tower's forward (the preprocess);
* ``mask``: one ``padded_causal_mask`` (each chunk builds its own, once: included in its forward);
* ``stage s fwd`` / ``stage s bwd``: the chunk of stage ``s`` (P = 2) recorded on the autograd
  tape and its backward, as the executors run them (the last chunk's backward from the loss's
  gradient);
* ``loss``: ``causal_lm_token_loss`` forward and backward on the last chunk's logits.

Per way: the median over ``--reps`` of each component, summed over the micro-batches, in ms and
in ms per 1,000 token slots (the micro-batches' ``input_ids`` sizes). ``--layer``: instead, one
decoder layer and its attention alone (forward + backward on random hidden states) at rows of
``--max-length`` tokens (packed) and at rows of the padded micro-batches' length (weighted by
their slots: ``sum(S^2) / sum(S)``), the same slots both ways, for each width of ``--widths``:
the attention's share of a layer, how much more a packed slot costs in the attention and in the
rest of the layer, the fraction of the ideal ``1 / (1 - padding)`` a step made of such layers
would reach, and the width at which that reaches 0.8 (a power law fitted to the excess).

Times are the process's CPU time on one pinned core (``--core``, as a benchmark rank is pinned),
not wall time: the other processes on a shared machine then shift them less.

Usage: ``python -m graph_exec.benchmarks.packing_profile [--hidden 256] [--steps 0,1] [--reps 3]``;
``python -m graph_exec.benchmarks.packing_profile --layer --widths 256,512,1024``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from graph_exec.benchmarks import packing_speed as ps
from graph_exec.benchmarks.common import argument_parser

PARTS = ("tensors", "tower", "mask", "stage 0 fwd", "stage 0 bwd", "stage 1 fwd", "stage 1 bwd", "loss")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated non-negative ints")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__, "packing_profile")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--hidden", type=int, default=256, help="decoder width (0: the preset's)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=640)
    parser.add_argument("--steps", type=_ints, default=(0, 1), help="the draws of packing_speed's steps")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median; default 3)")
    parser.add_argument("--layer", action="store_true", help="one decoder layer and its attention")
    parser.add_argument("--widths", type=_ints, default=(256, 512, 1024), help="--layer's widths")
    parser.add_argument(
        "--core", type=int, default=1, help="the one core to run on, as a pinned rank (-1: any; default 1)"
    )
    parser.add_argument("--rows", type=int, default=4, help="--layer: packed rows (default 4)")
    return parser


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn``'s CPU ms (this process's threads, all on the one ``--core``: what other processes
    take of that core is not counted, so a shared machine's load shifts the figures less) and
    its result, waited for."""
    start = time.process_time()
    out = fn()
    for t in out if isinstance(out, tuple) else (out,):
        if hasattr(t, "asnumpy"):
            t.asnumpy()
    return 1e3 * (time.process_time() - start), out


def _setup(args: argparse.Namespace):
    import graph_exec.models as gm
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    preset = _preset(args.size, args.hidden)
    split = gm.split_model(ps._model(preset, max(preset.layers, 2)), 2)
    return preset, split


def _preset(size: str, hidden: int):
    """``packing_speed``'s preset of ``size``, ``hidden`` wide (0: the preset's), the rest the
    preset's."""
    return ps._preset(argparse.Namespace(size=size, hidden=hidden, layers=0, vision_width=0, vision_depth=0))


def _made(split, preset, args: argparse.Namespace, step: int) -> dict[str, tuple]:
    """``packing_speed``'s micro-batches of ``step`` (pynative: each padded to its own)."""
    samples = ps.long_tailed(np.random.default_rng(step), args.batch, preset)
    ns = argparse.Namespace(
        ways=("padded", "packed"),
        mode="pynative",
        micro=args.micro,
        max_length=args.max_length,
        even_rows=False,
    )
    return ps._made(split, samples, ns, step)


def _micro_parts(split, batch) -> dict[str, float]:
    """One micro-batch's components, in ms."""
    import mindspore as ms
    from mindspore import ParameterTuple

    import graph_exec.models as gm
    from graph_exec.executors.tape import Tape
    from graph_exec.models.chunks import padded_causal_mask

    out: dict[str, float] = {}
    out["tensors"], (inputs, labels) = _timed(
        lambda: (tuple(ms.Tensor(a) for a in batch.inputs), ms.Tensor(batch.labels))
    )
    out["tower"], (ids, positions, mask, embeds) = _timed(lambda: split.preprocess(*inputs))
    first, last = split.stages
    out["mask"], _ = _timed(lambda: padded_causal_mask(mask, ms.float32, first.masked))
    tape0 = Tape(lambda *a: first(*a), ParameterTuple(first.trainable_params()), False)
    tape1 = Tape(lambda *a: last(*a), ParameterTuple(last.trainable_params()), True)
    args0 = (ids, positions, mask, embeds)
    out["stage 0 fwd"], (hidden, positions1, mask1) = _timed(lambda: tape0(*args0))
    args1 = (hidden, positions1, mask1)
    out["stage 1 fwd"], logits = _timed(lambda: tape1(*args1))

    def loss_and_grad():
        (total, _), grad = ms.value_and_grad(gm.causal_lm_token_loss, 0, has_aux=True)(logits, labels)
        return total, grad

    out["loss"], (_, dlogits) = _timed(loss_and_grad)
    out["stage 1 bwd"], (grads1, _) = _timed(lambda: tape1.backward(args1, dlogits))
    sens = (grads1[0], ms.ops.zeros_like(positions1), ms.ops.zeros_like(mask1))
    out["stage 0 bwd"], _ = _timed(lambda: tape0.backward(args0, sens))
    return out


def profile(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per way: each component's median ms summed over the micro-batches, and ``slots``."""
    preset, split = _setup(args)
    made = {step: _made(split, preset, args, step) for step in args.steps}
    ways = ("padded", "packed")
    runs: dict[tuple, list[dict[str, float]]] = {}
    for way in ways:  # warm-up: each way's first micro-batch
        _micro_parts(split, made[args.steps[0]][way][0][0])
    for rep in range(args.reps):
        for way in ways if rep % 2 else reversed(ways):
            for step, by_way in made.items():
                for m, batch in enumerate(by_way[way][0]):
                    runs.setdefault((way, step, m), []).append(_micro_parts(split, batch))
    table: dict[str, dict[str, float]] = {}
    for way in ways:
        keys = [k for k in runs if k[0] == way]
        row = {p: sum(statistics.median(r[p] for r in runs[k]) for k in keys) for p in PARTS}
        row["slots"] = float(sum(made[s][way][2] for s in args.steps))
        row["real"] = float(sum(made[s][way][1] for s in args.steps))
        row["rows"] = float(sum(b.inputs[3].shape[0] for s in args.steps for b in made[s][way][0]))
        table[way] = row
    return table


def _print_profile(table: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"packing_profile: Qwen2-VL {args.size} hidden {args.hidden}, steps {list(args.steps)}, "
        f"batch {args.batch}, M={args.micro}, rows of {args.max_length}, median of {args.reps}"
    )
    for way, row in table.items():
        print(
            f"  {way}: {row['slots']:.0f} slots in {row['rows']:.0f} rows "
            f"(mean {row['slots'] / row['rows']:.0f}), padding {1 - row['real'] / row['slots']:.0%}"
        )
    print(
        f"  {'component':12s} {'padded ms':>10s} {'packed ms':>10s} {'padded/1k':>10s} {'packed/1k':>10s} {'ratio/1k':>9s}"
    )
    for part in (*PARTS, "total"):
        values = []
        for way in ("padded", "packed"):
            row = table[way]
            ms_ = sum(row[p] for p in PARTS if p != "mask") if part == "total" else row[part]
            values.append((ms_, 1e3 * ms_ / row["slots"]))
        ratio = values[1][1] / values[0][1] if values[0][1] else float("nan")
        print(
            f"  {part:12s} {values[0][0]:10.1f} {values[1][0]:10.1f} {values[0][1]:10.2f} {values[1][1]:10.2f} {ratio:9.2f}"
        )


def batch_shapes(args: argparse.Namespace) -> tuple[float, float, float]:
    """``(padded length, padding padded, padding packed)`` of ``--steps``' micro-batches: the
    padded rows' length weighted by their slots (``sum(S^2) / sum(S)`` over rows, what a slot's
    share of the attention's square sees), and each way's padding."""
    preset, split = _setup(argparse.Namespace(**{**vars(args), "hidden": 0}))
    made = [_made(split, preset, args, step) for step in args.steps]
    lengths = np.array(
        [b.inputs[3].shape[1] for m in made for b in m["padded"][0] for _ in range(len(b.labels))]
    )
    padding = {w: 1 - sum(m[w][1] for m in made) / sum(m[w][2] for m in made) for w in ("padded", "packed")}
    return float((lengths**2).sum() / lengths.sum()), padding["padded"], padding["packed"]


def layer(args: argparse.Namespace) -> list[dict[str, float]]:
    """Per width: one decoder layer's and its attention's forward + backward, ms per 1,000
    slots, on ``--rows`` rows of ``--max-length`` tokens (packed) and on as many rows of the
    padded length (:func:`batch_shapes`) as hold the same slots."""
    import graph_exec.models as gm

    padded, pad_padded, pad_packed = batch_shapes(args)
    length = round(padded)
    rows = {"packed": args.rows, "padded": round(args.rows * args.max_length / length)}
    lengths = {"packed": args.max_length, "padded": length}
    out = []
    for width in args.widths:
        model = ps._model(_preset(args.size, width), 1)
        block = model.model.language_model.layers[0]
        rotary = gm.split_model(model, 1).stages[0].rotary
        times: dict[str, list[tuple[float, float]]] = {}
        for rep in range(args.reps + 1):  # rep 0 warms up
            for way in ("padded", "packed")[:: 1 if rep % 2 else -1]:
                t = _layer_times(block, rotary, rows[way], lengths[way], width)
                if rep:
                    times.setdefault(way, []).append(t)
        row: dict[str, float] = {
            "width": width,
            "padded_length": length,
            "pad_padded": pad_padded,
            "pad_packed": pad_packed,
        }
        for way in ("padded", "packed"):
            slots = rows[way] * lengths[way]
            row[f"{way}_layer"] = 1e3 * statistics.median(t[0] for t in times[way]) / slots
            row[f"{way}_attn"] = 1e3 * statistics.median(t[1] for t in times[way]) / slots
        out.append(row)
    return out


def of_ideal(row: dict[str, float]) -> float:
    """Packed over padded real tokens/s as a fraction of the ideal ``1 / (1 - padding padded)``
    if a step's time were its slots times one layer's cost per slot: ``(1 - padding packed) x
    padded cost / packed cost``."""
    return (1 - row["pad_packed"]) * row["padded_layer"] / row["packed_layer"]


def width_for(rows: list[dict[str, float]], target: float = 0.8) -> float | None:
    """The width at which :func:`of_ideal` reaches ``target``, from a power law fitted to the
    packed slot's excess cost ``packed / padded - 1`` over the measured widths (``None`` when
    the excess does not fall with the width)."""
    excess = [(r["width"], r["packed_layer"] / r["padded_layer"] - 1) for r in rows]
    if len(excess) < 2 or min(e for _, e in excess) <= 0:
        return None
    slope, level = np.polyfit(np.log([w for w, _ in excess]), np.log([e for _, e in excess]), 1)
    if slope >= 0:
        return None
    allowed = (1 - rows[0]["pad_packed"]) / target - 1
    return float(np.exp((np.log(allowed) - level) / slope)) if allowed > 0 else None


def _print_layer(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    first = rows[0]
    print(
        f"packing_profile --layer: one Qwen2-VL {args.size} decoder layer, forward + backward, {args.rows} rows "
        f"of {args.max_length} (packed) against rows of {first['padded_length']:.0f} (padded, slot-weighted "
        f"over steps {list(args.steps)}), the same slots; median of {args.reps}; padding padded "
        f"{first['pad_padded']:.0%}, packed {first['pad_packed']:.0%}"
    )
    print(
        f"  {'width':>6s} {'layer ms/1k padded':>18s} {'packed':>7s} {'packed/padded':>13s} "
        f"{'attn share padded':>17s} {'packed':>7s} {'attn packed/padded':>18s} {'rest packed/padded':>18s} "
        f"{'of ideal':>9s}"
    )
    for r in rows:
        rest = (r["packed_layer"] - r["packed_attn"]) / (r["padded_layer"] - r["padded_attn"])
        print(
            f"  {r['width']:6.0f} {r['padded_layer']:18.1f} {r['packed_layer']:7.1f} "
            f"{r['packed_layer'] / r['padded_layer']:13.2f} {r['padded_attn'] / r['padded_layer']:17.0%} "
            f"{r['packed_attn'] / r['packed_layer']:7.0%} {r['packed_attn'] / r['padded_attn']:18.2f} "
            f"{rest:18.2f} {of_ideal(r):9.2f}"
        )
    width = width_for(rows)
    print(f"  0.8 of the ideal from a width of about {width:,.0f} (power-law fit)" if width else "  no fit")


def _layer_times(block, rotary, rows: int, length: int, width: int) -> tuple[float, float]:
    """ms of one layer's and of its attention's forward + backward on ``rows`` x ``length``."""
    import mindspore as ms
    from mindspore import ParameterTuple

    from graph_exec.models.chunks import mask_value, padded_causal_mask

    rng = np.random.default_rng(0)
    hidden = ms.Tensor(rng.standard_normal((rows, length, width)).astype(np.float32))
    segments = np.zeros((rows, length), np.int32)
    segments[:, : length - 8] = 1
    mask = padded_causal_mask(ms.Tensor(segments), ms.float32, mask_value(ms.float32))
    positions = ms.Tensor(np.broadcast_to(np.arange(length, dtype=np.int32), (3, rows, length)).copy())
    cos, sin = rotary(hidden, positions)

    def whole(x):
        return block(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))[0]

    def attention(x):
        return block.self_attn(
            x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin)
        )[0]

    times = []
    for fn, cell in ((whole, block), (attention, block.self_attn)):
        grad = ms.value_and_grad(fn, 0, ParameterTuple(cell.trainable_params()))
        ms_, _ = _timed(lambda grad=grad: grad(hidden)[0])
        times.append(ms_)
    return times[0], times[1]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.core >= 0:  # before MindSpore starts its threads, which inherit it
        os.sched_setaffinity(0, {args.core})
    if args.layer:
        _print_layer(layer(args), args)
        return 0
    _print_profile(profile(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
