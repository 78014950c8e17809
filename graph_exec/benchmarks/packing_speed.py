"""Sequence packing: real tokens per second packed against padded, and balanced against token-only rows.

One process holds both stages of a random Qwen2-VL (``--size``, P = 2, ``ScheduleMPipeTranspose``,
``loss_reduction="token"``) and trains the same samples per step three ways, the ways alternating
every step so that machine noise hits them alike:

* ``padded``: ``vlm_micro_batches`` of the samples in the order drawn (each micro-batch padded
  to its own longest sample and its largest patch count, both bucketed);
* ``packed``: ``pack(..., balance="tower")`` into rows of ``--max-length`` tokens,
  ``vlm_packed_micro_batches``;
* ``tokens``: ``pack(..., balance="tokens")``: rows filled by tokens alone.

The mix (``--mix``): ``long-tailed`` (text 16-512 tokens log-uniform, 0-2 images per sample of
three sizes: the throughput target) or ``skewed`` (one image per sample, the samples of one group
in four with 4x the patches, as ``bench qwen2vl --image-mix skewed`` draws them; the balance
target). Per way: the run() time per step (p10/p50/p90 after ``--warmup`` steps), the real tokens
per second at the median, the padding fraction of its token slots, and the micro-batches' tower
costs (patches) max/mean. For the throughput target the ratio of packed to padded real tokens/s is
printed beside the ideal ``(1 - padding packed) / (1 - padding padded)``.

``--max-length`` must hold the longest sample (text up to 512 tokens plus two images: 588 tokens
with the tiny preset's largest image). Run ``python -m graph_exec.benchmarks.packing_speed
[--help]`` (pin it, e.g. ``taskset -c 0,1``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from graph_exec.benchmarks.common import argument_parser, p10_p50_p90

WAYS = ("padded", "packed", "tokens")
#: Image sides in patches-times-merge units of the preset (three sizes: 1x, 2x, 3x the side).
SIDES = (1, 2, 3)


def _parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__, "packing_speed")
    parser.add_argument("--mix", choices=("long-tailed", "skewed"), default="long-tailed")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny", help="Qwen2-VL preset")
    parser.add_argument("--batch", type=int, default=16, help="samples per step (default 16)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row (default 1024)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per way (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured first steps (default 2)")
    parser.add_argument("--mode", choices=("pynative", "graph"), default="pynative")
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


def _buckets(largest: int) -> tuple[int, ...]:
    """Powers of two from 64 up to ``largest`` (and ``largest``): a bounded set of shapes."""
    sizes, size = [], 64
    while size < largest:
        sizes.append(size)
        size *= 2
    return (*sizes, largest)


def _ways(split, samples: list[dict], args: argparse.Namespace, seed: int) -> dict[str, tuple]:
    """Per way: ``(micro-batches, real tokens, token slots, tower costs)``."""
    import graph_exec.models as gm
    from graph_exec.data import pack

    costs = gm.vlm_sample_costs(split, samples)
    real = sum(c.tokens for c in costs)
    patch_buckets = _buckets(max(4096, 2 * max(c.patches for c in costs)))
    order = list(range(len(samples)))  # padded: in the order drawn, as a loader gives them
    rows = len(samples) // args.micro
    padded = gm.vlm_micro_batches(
        split,
        [samples[i] for i in order],
        args.micro,
        pad_to=_buckets(args.max_length),
        patch_pad_to=patch_buckets,
    )
    out = {
        "padded": (
            padded,
            real,
            sum(b.inputs[3].size for b in padded),
            [
                float(sum(costs[i].patches for i in order[m * rows : (m + 1) * rows]))
                for m in range(args.micro)
            ],
        )
    }
    for way, balance in (("packed", "tower"), ("tokens", "tokens")):
        packing = pack(costs, args.max_length, args.micro, balance=balance, seed=seed)
        batches = gm.vlm_packed_micro_batches(
            split, samples, packing, args.max_length, patch_pad_to=patch_buckets
        )
        out[way] = (batches, real, sum(b.inputs[3].size for b in batches), packing.tower_costs(costs))
    return out


def _step(sched, batches) -> float:
    import mindspore as ms

    tensors = [(tuple(ms.Tensor(a) for a in b.inputs), ms.Tensor(b.labels)) for b in batches]
    sched.zero_grad()
    start = time.perf_counter()
    losses = sched.run(micro_batches=tensors)
    for loss in losses:
        loss.asnumpy()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    import graph_exec as ge
    import graph_exec.models as gm
    from graph_exec.data import spread
    from graph_exec.examples import qwen2vl

    preset = qwen2vl.SIZES[args.size]
    split = gm.split_model(qwen2vl.model(args.size, max(preset.layers, 2)), 2)
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(split.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        args.micro,
        split.preprocess,
        split.num_transpose_layers,
        mode=args.mode,
        loss_fn=gm.causal_lm_token_loss,
        loss_reduction="token",
    )
    draw: Callable[[int], list[dict]] = (
        (lambda step: long_tailed(np.random.default_rng(step), args.batch, preset))
        if args.mix == "long-tailed"
        else (lambda step: skewed(np.random.default_rng(step), args.batch, args.micro, step, preset))
    )
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    tokens: dict[str, list[tuple[int, int]]] = {w: [] for w in WAYS}
    spreads: dict[str, list[float]] = {w: [] for w in WAYS}
    for step in range(args.warmup + args.steps):
        made = _ways(split, draw(step), args, step)
        for way in WAYS if step % 2 == 0 else reversed(WAYS):
            batches, real, slots, tower = made[way]
            seconds = _step(sched, batches)
            if step >= args.warmup:
                times[way].append(seconds)
                tokens[way].append((real, slots))
                spreads[way].append(spread(tower))
    print(
        f"packing_speed: Qwen2-VL {args.size}, P=2 in one process, {args.mode}, {args.mix} mix, "
        f"batch {args.batch}, M={args.micro}, max_length {args.max_length}, {args.steps} steps after {args.warmup}"
    )
    rates = {}
    for way in WAYS:
        p10, p50, p90 = p10_p50_p90(times[way])
        real = sum(r for r, _ in tokens[way])
        padding = 1 - real / sum(s for _, s in tokens[way])
        rates[way] = (real / sum(times[way]), padding)
        print(
            f"  {way:7s} run() ms p10/p50/p90 {p10 * 1e3:8.1f} {p50 * 1e3:8.1f} {p90 * 1e3:8.1f}  "
            f"{rates[way][0]:9,.0f} real tokens/s  padding {padding:.0%}  "
            f"tower max/mean {np.mean(spreads[way]):.2f}"
        )
    ratio = rates["packed"][0] / rates["padded"][0]
    ideal = (1 - rates["packed"][1]) / (1 - rates["padded"][1])
    print(f"  packed / padded real tokens/s {ratio:.2f}x (ideal {ideal:.2f}x: {ratio / ideal:.2f} of it)")
    print(f"  packed / tokens-only step time {np.median(times['packed']) / np.median(times['tokens']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
