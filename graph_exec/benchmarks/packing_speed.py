"""Sequence packing: real tokens per second packed against padded (and balanced against token-only rows).

Each repeat is one msrun launch of two ranks pinned as the harness pins them (``pin_cores``: one
core each on 2 cores), each holding one stage of a random Qwen2-VL (``--size``'s tower and
images, ``--hidden`` wide, P = 2, ``ScheduleMPipeTranspose`` with ``tower_order="balanced"``
placing by each way's micro-batches' tower work (padded: their real patches, each micro-batch padded
to its own; packed: ``Packing.tower_work``, rows x the fullest row's patches, what a packed tower
computes), ``loss_reduction="token"``, ``--mode``), and trains the same samples per step in each way of ``--ways``, the ways alternating
every step so that machine noise hits them alike:

* ``padded``: ``vlm_micro_batches`` of the samples in the order drawn, each micro-batch padded to
  its own longest sample and patch count (graph mode: to ``--max-length`` / 2 or ``--max-length``
  tokens and a power of four from 256 patches, few shapes);
* ``packed``: ``pack(..., balance="tower", ragged=True)`` into rows of ``--max-length`` tokens,
  ``vlm_packed_micro_batches``: each micro-batch as many rows as it holds (the batch's best-fit
  rows dealt whole; graph mode: each rounded up to its own bucket of ``row_buckets_upto``, few
  shapes); ``--even-rows``: every micro-batch padded to the fullest one's count (the old way);
* ``tokens``: ``pack(..., balance="tokens")``: rows filled by tokens alone (the balance target,
  with ``--mix skewed``).

A step's time is the slower rank's ``run()``. In graph mode a step in which some way meets a shape
it has not run before compiles (``--shapes static``): it runs but is not measured, and neither is
any way of that step; the launch goes on until ``--steps`` steps are measured or ``--warmup + 4 x
--steps`` steps have run. Per repeat and way: real tokens/s (real tokens over the measured steps'
summed time), the padding fraction of its token slots, ms per 1,000 token slots (equal across ways
when the step's time follows its slots, which the ideal assumes) and the micro-batches' tower work
(as placed) max/mean; then packed / padded real tokens/s against the ideals ``1 / (1 - padding
padded)`` (the issue's figure: packed rows without padding) and ``(1 - padding packed) / (1 -
padding padded)`` (the packed rows' own padding counted), and the ratio over each. Last, the
spread (min-max) over the repeats.

The mix (``--mix``): ``long-tailed`` (text 16-512 tokens log-uniform, 0-2 images per sample of
three sizes: the throughput target) or ``skewed`` (one image per sample, the samples of one group
in four with 4x the patches, as ``bench qwen2vl --image-mix skewed`` draws them). ``--max-length``
must hold the longest sample (512 text tokens and two images of the preset's largest size: 588
for ``tiny``, 804 for ``small``).

Why the defaults (pynative, ``tiny`` 256 wide, batch 32, M = 2, rows of 640 tokens, 4 measured
steps after 1): the ratio means something only where a step's time follows its token slots.
Pynative ``tiny`` (64 wide) did not: launch overhead dominated, a padded step took the time of a
packed one with 2.6x fewer slots. Graph mode did, but every compiled shape keeps its graphs'
memory: ``small`` at rows of 1024 grew a rank to 12.7 GB, and what fitted (``tiny``, one fixed row
count per launch) left packed rows 75 % padding. So pynative at a width where the matmuls dominate
(no compile memory at all; the attention, dense with a block-diagonal mask, grows with the row
length, so packed rows of 640 cost a little more per slot than shorter padded ones): a sizing run
on the shared machine (2026-12-06, load 5-11, 1 repeat of 2 measured steps) gave 3,041 against
3,192 ms per 1k slots (padded, packed: within 5 %), padding 63 % padded and 17 % packed, packed
2.13x = 0.79 of the ideal 1 / (1 - padding) and 0.95 of it with the packed rows' padding, a rank
under 3.3 GB (rows then even: every micro-batch padded to the fullest one's row count). Packed
padding varies by draw: over the draws of steps 0-7 the packer gives 10.5 % on average with even
rows and 7.1 % ragged (``tests/unit/test_packer.py``; padded 63 %), hence 4 measured steps. Packing needs many samples per micro-batch for
full rows (hence M = 2, 16 samples each); ``small`` in pynative at rows of 1024 and M = 4 ran a
rank out of memory (13 GB: the attention's square over M micro-batches in flight).

``--layers`` (default the preset's 4) trades depth for width: the packed slot's extra cost is
the dense attention's square (``packing_profile``), a smaller share of a layer the wider it is.
One layer's time per slot roughly doubles with the width (one pinned process, 2026-12-06: 0.30-0.37,
0.59-0.76 and 1.33-1.73 ms per slot at 256, 512 and 1024), so ``--hidden 1024 --layers 2``
takes about the time of ``--hidden 512`` (4 layers) and ``--hidden 512 --layers 2`` that of the default.

The balance target's step time (``--mix skewed --ways packed,tokens``): each way prints its ms per
step and the tokens/packed step-time line beside both tower max/mean. It shows only where the
tower is a visible share of the step, hence ``--vision-width`` / ``--vision-depth``: with ``--hidden
0`` (the preset's 64) and a tower 256 wide x 12 blocks, one process on one core (2026-12-06, load
6) ran a packed micro-batch's frozen tower forward in 0.8-3.3 s against its decoder forward's
0.8-1.3 s; step 0's balanced rows put 2.1 and 1.3 s of tower in the two micro-batches, token-only
rows 0.8 and 3.3 s (the tower runs each row padded to its fullest row's patches, so it follows
rows x most patches more than the real patches; the packer now balances that work,
``Packing.tower_work``). A sizing launch under load (1 repeat, 3 measured
steps, before the towers were placed ``balanced``) gave 10.6 s per step balanced and 10.3 s token-only (0.97x: within that load's noise),
ranks under 1.5 GB.

Usage: ``python -m graph_exec.benchmarks.packing_speed [--repeats 3] [--help]`` (run under the
machine's lock, ``flock /tmp/ge-dist.lock ...``, on an otherwise quiet machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from graph_exec.benchmarks.common import RESULT, argument_parser, launch_and_report

WAYS = ("padded", "packed", "tokens")
#: Image sides in patches-times-merge units of the preset (three sizes: 1x, 2x, 3x the side).
SIDES = (1, 2, 3)


def _ways(text: str) -> tuple[str, ...]:
    ways = tuple(text.split(","))
    if not ways or any(w not in WAYS for w in ways) or len(set(ways)) != len(ways):
        raise argparse.ArgumentTypeError(f"--ways {text!r}: a comma-separated subset of {','.join(WAYS)}")
    return ways


def _parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__, "packing_speed")
    parser.add_argument("--mix", choices=("long-tailed", "skewed"), default="long-tailed")
    parser.add_argument(
        "--size", choices=("tiny", "small"), default="tiny", help="Qwen2-VL preset (default tiny)"
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="the decoder's width, in place of the preset's (0: the preset's; default 256)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers, in place of the preset's (0: the preset's; at least 2, one per stage; default 0)",
    )
    parser.add_argument(
        "--vision-width",
        type=int,
        default=0,
        help="the vision tower's width, in place of the preset's (0: the preset's; default 0)",
    )
    parser.add_argument(
        "--vision-depth",
        type=int,
        default=0,
        help="the vision tower's blocks, in place of the preset's (0: the preset's; default 0)",
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--max-length", type=int, default=640, help="tokens per packed row (default 640)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per repeat (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured first steps (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="launches, one after another (default 3)")
    parser.add_argument("--mode", choices=("pynative", "graph"), default="pynative")
    parser.add_argument(
        "--shapes",
        choices=("static", "dynamic"),
        default="static",
        help="the schedule's shapes (default static)",
    )
    parser.add_argument(
        "--ways", type=_ways, default=("padded", "packed"), help="comma-separated, of padded,packed,tokens"
    )
    parser.add_argument(
        "--even-rows",
        action="store_true",
        help="packed micro-batches all padded to the fullest one's row count (default: each its own)",
    )
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    return parser


def long_tailed(rng: np.random.Generator, batch: int, preset) -> list[dict]:
    """Text 16-512 tokens (log-uniform), 0-2 images each of one of three sizes."""
    samples = []
    for _ in range(batch):
        sides = [SIDES[int(k)] for k in rng.integers(0, len(SIDES), int(rng.integers(0, 3)))]
        text = int(np.exp(rng.uniform(np.log(16), np.log(512))))
        samples.append(_sample(rng, [(s * preset.image, s * preset.image) for s in sides], text, preset))
    return samples


def skewed(rng: np.random.Generator, batch: int, micro: int, step: int, preset) -> list[dict]:
    """One image each; the samples of the skewed mix's heavy groups 4x the patches."""
    from graph_exec.report import image_mix

    samples = []
    for heavy in image_mix.heavy_micros("skewed", micro, step):
        side = image_mix.heavy_side(preset.image)[0] if heavy else preset.image
        for _ in range(batch // micro):
            text = int(np.exp(rng.uniform(np.log(16), np.log(512))))
            samples.append(_sample(rng, [(side, side)], text, preset))
    return samples


def _sample(rng: np.random.Generator, sizes: list[tuple[int, int]], text: int, preset) -> dict:
    from graph_exec.examples import qwen2vl

    return qwen2vl.random_sample(sizes, text, preset, rng)


def _buckets(largest: int, smallest: int = 256) -> tuple[int, ...]:
    """Powers of four from ``smallest`` up to ``largest`` (and ``largest``): few shapes, since in
    graph mode every new shape compiles and keeps its graphs' memory (with power-of-two buckets a
    rank passed 7 GB within a minute, static or dynamic shapes)."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 4
    return (*sizes, largest)


def _made(split, samples: list[dict], args: argparse.Namespace, seed: int) -> dict[str, tuple]:
    """Per way of ``args.ways``: ``(micro-batches, real tokens, token slots, tower costs)``.
    Graph mode pads to few shapes (each compiles); pynative pads each micro-batch to its own
    sizes. Packed rows per micro-batch: what each holds (``--even-rows``: the fullest one's), in
    graph mode rounded up to a row bucket."""
    import graph_exec.models as gm
    from graph_exec.data import pack, row_buckets_upto

    costs = gm.vlm_sample_costs(split, samples)
    real = sum(c.tokens for c in costs)
    graph = args.mode == "graph"
    patch_buckets = _buckets(max(4096, max(c.patches for c in costs))) if graph else None
    out = {}
    if "padded" in args.ways:  # in the order drawn, as a loader gives them
        rows = len(samples) // args.micro
        padded = gm.vlm_micro_batches(
            split,
            samples,
            args.micro,
            pad_to=(args.max_length // 2, args.max_length) if graph else None,
            patch_pad_to=patch_buckets,
        )
        tower = [float(sum(c.patches for c in costs[m * rows : (m + 1) * rows])) for m in range(args.micro)]
        out["padded"] = (padded, real, sum(b.inputs[3].size for b in padded), tower)
    for way, balance in (("packed", "tower"), ("tokens", "tokens")):
        if way in args.ways:
            buckets = row_buckets_upto(len(samples)) if graph else None
            packing = pack(
                costs,
                args.max_length,
                args.micro,
                balance=balance,
                seed=seed,
                row_buckets=buckets,
                ragged=not args.even_rows,
            )
            batches = gm.vlm_packed_micro_batches(
                split, samples, packing, args.max_length, patch_pad_to=patch_buckets
            )
            slots = sum(b.inputs[3].size for b in batches)
            out[way] = (batches, real, slots, packing.tower_work(costs))
    return out


def _signature(batches) -> tuple:
    return tuple(tuple(np.shape(a) for a in b.inputs) for b in batches)


def _step(sched, batches, tower: list[float]) -> float:
    """One step's seconds; ``tower``: the micro-batches' tower work, what ``tower_order="balanced"``
    places the towers by."""
    import mindspore as ms

    tensors = [(tuple(ms.Tensor(a) for a in b.inputs), ms.Tensor(b.labels)) for b in batches]
    sched.zero_grad()
    start = time.perf_counter()
    losses = sched.run(micro_batches=tensors, tower_costs=tower)
    for loss in losses or ():
        loss.asnumpy()
    return time.perf_counter() - start


def _preset(args: argparse.Namespace):
    """The ``--size`` preset, ``--hidden`` wide and ``--layers`` deep, its tower ``--vision-width``
    wide and ``--vision-depth`` deep (each 0: the preset's; the images as the preset's)."""
    import dataclasses

    from graph_exec.examples import qwen2vl

    preset = qwen2vl.SIZES[args.size]
    given = {
        "hidden": args.hidden,
        "layers": args.layers,
        "vision_width": args.vision_width,
        "vision_depth": args.vision_depth,
    }
    return dataclasses.replace(preset, **{k: v for k, v in given.items() if v})


def _model(preset, layers: int):
    """A random whole Qwen2-VL of ``preset`` (seeded: the same on every rank)."""
    import mindspore as ms

    import graph_exec.models as gm
    from graph_exec.examples import qwen2vl

    ms.set_seed(0)
    return gm.mindone().Qwen2VLForConditionalGeneration(qwen2vl.config(preset, layers, preset.vision_depth))


def _worker(args: argparse.Namespace) -> int:
    """One rank: build its stage, run the ways step by step, print one ``RESULT`` line."""
    from graph_exec.harness.worker import pin_cores

    pin_cores(2)  # before MindSpore starts its threads
    from mindspore.communication import get_group_size, get_rank, init

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    import graph_exec as ge
    import graph_exec.models as gm
    from graph_exec.data import spread

    rank, pp = get_rank(), get_group_size()
    preset = _preset(args)
    split = gm.split_model(_model(preset, max(preset.layers, pp)), pp)
    sched = ge.ScheduleMPipeTranspose(
        [ge.PipelineStage(split.stages[rank], rank, pp)],
        args.micro,
        split.preprocess,
        split.num_transpose_layers,
        mode=args.mode,
        loss_fn=gm.causal_lm_token_loss,
        loss_reduction="token",
        tower_order="balanced",
        shapes=args.shapes,
        timeout_s=600,
    )
    draw: Callable[[int], list[dict]] = (
        (lambda step: long_tailed(np.random.default_rng(step), args.batch, preset))
        if args.mix == "long-tailed"
        else (lambda step: skewed(np.random.default_rng(step), args.batch, args.micro, step, preset))
    )
    limit = args.warmup + 4 * args.steps
    compiles = args.mode == "graph" and args.shapes == "static"
    seen: set[tuple] = set()
    steps: list[dict] = []
    step = 0
    while len([s for s in steps if s["measured"]]) < args.steps and step < limit:
        made = _made(split, draw(step), args, step)
        fresh = compiles and any((way, _signature(made[way][0])) not in seen for way in args.ways)
        record = {"measured": step >= args.warmup and not fresh}
        for way in args.ways if step % 2 == 0 else reversed(args.ways):
            batches, real, slots, tower = made[way]
            seen.add((way, _signature(batches)))
            record[way] = {
                "s": _step(sched, batches, tower),
                "real": real,
                "slots": slots,
                "spread": spread(tower),
            }
        steps.append(record)
        step += 1
    print(RESULT + json.dumps({"rank": rank, "steps": steps}), flush=True)
    return 0


def _summarise(reports: list[dict], ways: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """One launch: per way real tokens/s (the slower rank of each measured step), padding,
    ms per 1,000 token slots, tower max/mean."""
    per_rank = [r["steps"] for r in reports]
    measured = [k for k, s in enumerate(per_rank[0]) if s["measured"]]
    out = {}
    for way in ways:
        seconds = sum(max(r[k][way]["s"] for r in per_rank) for k in measured)
        real = sum(per_rank[0][k][way]["real"] for k in measured)
        slots = sum(per_rank[0][k][way]["slots"] for k in measured)
        out[way] = {
            "tokens_s": real / seconds,
            "padding": 1 - real / slots,
            "ms_per_1k_slots": 1e6 * seconds / slots,
            "step_ms": 1e3 * seconds / max(len(measured), 1),
            "tower": float(np.mean([per_rank[0][k][way]["spread"] for k in measured])),
            "steps": len(measured),
        }
    return out


def _ratios(run: dict[str, dict[str, float]]) -> tuple[float, float, float]:
    """packed / padded real tokens/s, the ideal 1 / (1 - padding padded), and the ideal with
    the packed rows' own padding."""
    ratio = run["packed"]["tokens_s"] / run["padded"]["tokens_s"]
    return (
        ratio,
        1 / (1 - run["padded"]["padding"]),
        (1 - run["packed"]["padding"]) / (1 - run["padded"]["padding"]),
    )


def _print_run(k: int, run: dict[str, dict[str, float]]) -> None:
    for way, m in run.items():
        print(
            f"  repeat {k + 1} {way:7s} {m['step_ms']:8,.0f} ms/step {m['tokens_s']:9,.0f} real tokens/s  "
            f"padding {m['padding']:.0%}  "
            f"{m['ms_per_1k_slots']:7.2f} ms per 1k slots  tower max/mean {m['tower']:.2f}  ({m['steps']} steps)"
        )
    if {"packed", "tokens"} <= set(run):
        print(f"  repeat {k + 1} {_balance_line(run)}")
    if {"packed", "padded"} <= set(run):
        ratio, ideal, own = _ratios(run)
        print(
            f"  repeat {k + 1} packed/padded {ratio:.2f}x; ideal 1/(1-padding) {ideal:.2f}x: {ratio / ideal:.2f} of it; "
            f"with the packed rows' padding {own:.2f}x: {ratio / own:.2f} of it"
        )


def _balance_line(run: dict[str, dict[str, float]]) -> str:
    """Rows packed by tokens alone against balanced rows: step time and tower max/mean."""
    tokens, packed = run["tokens"], run["packed"]
    return (
        f"tokens/packed step time {tokens['step_ms'] / packed['step_ms']:.3f}x "
        f"(tower max/mean {tokens['tower']:.2f} against {packed['tower']:.2f})"
    )


def _print_spread(runs: list[dict[str, dict[str, float]]], ways: tuple[str, ...]) -> None:
    def span(values: list[float], fmt: str) -> str:
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    print(f"spread over {len(runs)} repeats (min-max):")
    for way in ways:
        print(
            f"  {way:7s} ms/step {span([r[way]['step_ms'] for r in runs], ',.0f')}, "
            f"real tokens/s {span([r[way]['tokens_s'] for r in runs], ',.0f')}"
        )
    if {"packed", "tokens"} <= set(ways):
        slower = [r["tokens"]["step_ms"] / r["packed"]["step_ms"] for r in runs]
        print(f"  tokens/packed step time {span(slower, '.3f')}x")
    if {"packed", "padded"} <= set(ways):
        ratios = [_ratios(r) for r in runs]
        print(
            f"  packed/padded {span([r for r, _, _ in ratios], '.2f')}x, of the ideal 1/(1-padding) "
            f"{span([r / i for r, i, _ in ratios], '.2f')}, of the ideal with the packed rows' padding "
            f"{span([r / o for r, _, o in ratios], '.2f')}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--hidden", args.hidden), ("--vision-width", args.vision_width)):
        if value < 0 or value % 32:
            parser.error(f"{flag} {value}: 0 (the preset's) or a positive multiple of 32 (4 heads of 8+)")
    if args.layers < 0 or args.layers == 1:
        parser.error(f"--layers {args.layers}: 0 (the preset's) or at least 2 (one per stage of P = 2)")
    if args.vision_depth < 0:
        parser.error(f"--vision-depth {args.vision_depth}: 0 (the preset's) or a positive number of blocks")
    if args.as_rank:
        return _worker(args)
    keys = (
        "mix",
        "size",
        "hidden",
        "layers",
        "vision_width",
        "vision_depth",
        "batch",
        "micro",
        "max_length",
        "steps",
        "warmup",
        "mode",
        "shapes",
    )
    forwarded = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in keys] + [
        f"--ways={','.join(args.ways)}"
    ]
    forwarded += ["--even-rows"] if args.even_rows else []
    preset = _preset(args)
    print(
        f"packing_speed: Qwen2-VL {args.size} (hidden {preset.hidden}, {preset.layers} layers, tower "
        f"{preset.vision_width} wide x {preset.vision_depth}), P=2 on 2 pinned ranks, {args.mode}, {args.shapes} shapes, "
        f"{args.mix} mix, "
        f"batch {args.batch}, M={args.micro}, max_length {args.max_length} "
        f"({'even' if args.even_rows else 'ragged'} rows), {args.steps} measured steps "
        f"(first {args.warmup} unmeasured; static: also those compiling), {args.repeats} repeats"
    )
    runs = []
    for k in range(args.repeats):
        reports: list[dict] = []
        began = time.perf_counter()
        status = launch_and_report(
            __file__,
            ["--as-rank", *forwarded],
            nproc=2,
            timeout_s=1800,
            heading=f"repeat {k + 1}/{args.repeats}",
            sink=lambda line, into=reports: into.append(json.loads(line)),
        )
        if status:
            return status
        runs.append(_summarise(reports, args.ways))
        _print_run(k, runs[-1])
        print(f"  repeat {k + 1} took {time.perf_counter() - began:.0f} s", flush=True)
    _print_spread(runs, args.ways)
    return 0


if __name__ == "__main__":
    sys.exit(main())
