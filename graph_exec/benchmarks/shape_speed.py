"""Variable sequence lengths in graph mode: ``shapes="static"``, ``"buckets"`` and ``"dynamic"``.

``embed_lm`` (one process holding both stages, ``V = 2``; graph mode) trains ``--steps`` steps
whose sequence lengths are drawn uniformly from ``--lengths MIN,MAX`` (the same draw for both
variants). ``static`` runs every batch as it comes (a new length compiles new kernels);
``buckets`` pads each batch up to the next of ``--buckets`` and trains with the masked loss;
``dynamic`` pads nothing: each kernel compiles a static graph for its first shape and one
MindSpore dynamic-shape graph for every other (two compilations per kernel, plus a static graph
for a length that keeps coming back; ``graph_exec/executors/dynamic_kernel.py``).
Each variant runs in a fresh process (MindSpore's compile cache and allocator then start
empty) and reports: the wall time of all steps, compilation included; the library's
compilations and MindSpore's own count of compiled ``jit`` graphs; the kernel cache's
evictions; and the steady-state step at lengths both have seen (``--steady-lengths``, each
after two warm-up steps at it; p10 / p50 / p90 of ``--steady-steps`` steps): by default one
inside a bucket (padded) and one on a bucket size (nothing padded).

Run ``python -m graph_exec.benchmarks.shape_speed [--help]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from graph_exec.benchmarks.common import argument_parser, p10_p50_p90

VARIANTS = ("static", "buckets", "dynamic")


def _parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__, "shape_speed")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--lengths", default="16,256", help="MIN,MAX sequence lengths (default 16,256)")
    parser.add_argument("--buckets", default="64,128,192,256", help="bucket sizes (default 64,128,192,256)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches (default 2)")
    parser.add_argument(
        "--size", choices=("tiny", "small"), default="tiny", help="embed_lm size (default tiny)"
    )
    parser.add_argument(
        "--steady-lengths", default="100,128", help="lengths of the steady-state steps (default 100,128)"
    )
    parser.add_argument("--steady-steps", type=int, default=10, help="timed steady-state steps (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length draw (default 0)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    return parser


def _pair(text: str) -> tuple[int, int]:
    low, high = _ints(text)
    return low, high


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _run_variant(args: argparse.Namespace) -> dict:
    """One variant in this process: the draw, the steps, the counters."""
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    import graph_exec as ge
    from graph_exec.examples import embed_lm
    from graph_exec.examples.lm import lm_cross_entropy, masked_lm_cross_entropy

    low, high = _pair(args.lengths)
    buckets = tuple(int(v) for v in args.buckets.split(","))
    lengths = np.random.default_rng(args.seed).integers(low, high + 1, args.steps)
    model = embed_lm.build(
        2, trainable_preprocess=True, size=args.size, max_seq=max(high, *_ints(args.steady_lengths))
    )
    stages = [ge.PipelineStage(model.stages[s], s, 2) for s in range(2)]
    bucketed = args.variant == "buckets"
    options = {"shapes": args.variant, **({"shape_buckets": {1: buckets}} if bucketed else {})}
    sched = ge.ScheduleMPipeTranspose(
        stages,
        args.micro,
        model.preprocess,
        model.num_transpose_layers,
        loss_fn=masked_lm_cross_entropy if bucketed else lm_cross_entropy,
        scale_grads=True,
        **options,
    )

    def step(index: int, length: int) -> float:
        (x,), y = model.batch(index, args.batch, int(length))
        begin = time.perf_counter()
        losses = sched.run(x, labels=y)
        float(losses[-1].asnumpy())
        sched.zero_grad()
        return time.perf_counter() - begin

    begin = time.perf_counter()
    for index, length in enumerate(lengths):
        step(index, length)
    total = time.perf_counter() - begin
    stats = sched.stats()
    steady = {}
    for length in _ints(args.steady_lengths):
        for index in range(2):
            step(1000 + index, length)
        times = [step(2000 + index, length) for index in range(args.steady_steps)]
        steady[str(length)] = [1e3 * v for v in p10_p50_p90(times)]
    return {
        "variant": args.variant,
        "distinct_lengths": len(set(lengths.tolist())),
        "total_s": total,
        "compilations": stats["compilations"],
        "compile_s": stats["compile_seconds"],
        "mindspore_compilations": stats["mindspore_compilations"],
        "evictions": stats["kernel_cache"]["evictions"],
        "steady_ms": steady,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.variant is not None:
        print(json.dumps(_run_variant(args)), flush=True)
        return 0
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, "-m", "graph_exec.benchmarks.shape_speed", *(argv or sys.argv[1:])]
        out = subprocess.run([*command, "--variant", variant], capture_output=True, text=True, check=False)
        if out.returncode:
            print(out.stdout, out.stderr, file=sys.stderr)
            return out.returncode
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    low, high = _pair(args.lengths)
    print(
        f"embed_lm {args.size}, one process holding 2 stages (V=2), graph mode, batch {args.batch}, "
        f"micro {args.micro}, {args.steps} steps, lengths uniform in {low}-{high} "
        f"({results['static']['distinct_lengths']} distinct), buckets {args.buckets}"
    )
    lengths = _ints(args.steady_lengths)
    steady_head = "  ".join(f"steady ms p10/p50/p90 at {n}" for n in lengths)
    print(
        f"{'variant':8} {'total s':>8} {'compiles':>9} {'ms jit':>7} {'compile s':>10} {'evicted':>8}   {steady_head}"
    )
    for variant, r in results.items():
        ms_count = "-" if r["mindspore_compilations"] is None else str(r["mindspore_compilations"])
        spreads = "  ".join(
            "{:.1f} / {:.1f} / {:.1f}".format(*r["steady_ms"][str(n)]).ljust(
                len(f"steady ms p10/p50/p90 at {n}")
            )
            for n in lengths
        )
        print(
            f"{variant:8} {r['total_s']:8.1f} {r['compilations']:9d} {ms_count:>7} {r['compile_s']:10.1f} "
            f"{r['evictions']:8d}   {spreads}"
        )
    static = results["static"]
    for variant in VARIANTS[1:]:
        other = results[variant]
        ratios = ", ".join(
            f"{other['steady_ms'][str(n)][1] / static['steady_ms'][str(n)][1]:.2f}x at {n}" for n in lengths
        )
        print(
            f"{variant} vs static: {static['total_s'] / other['total_s']:.2f}x faster over the {args.steps} "
            f"steps (compilation included); steady step p50, {variant} / static: {ratios}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
