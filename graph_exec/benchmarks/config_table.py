"""The docs' "does it fit?" table: Qwen2-VL-2B / 7B / 72B priced by ``graph-exec tune --config``.

For every model, P in ``--pp``, D in ``--dp`` and ZeRO-1 off/on (on only where D >= 2), the
smallest per-rank peak of each schedule (interleaved 1F1B "baseline", MPipe ``full`` and
``min``) over V, M and recompute, as :func:`graph_exec.tune.tune` ranks them for
``graph-exec tune --config tests/data/configs/MODEL --ranks P --dp D [--zero 1]`` (the same
function, the same costs), with rank 0's parameter and optimizer bytes written out beside it
for a hand check. Pure Python; no time is predicted.

Usage: ``python -m graph_exec.benchmarks.config_table [--pp 4,8] [--dp 1,4] [--seq-len 4096]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graph_exec.config_sizes import (
    DTYPE_BYTES,
    Workload,
    config_costs,
    model_shape,
    param_counts,
    read_config,
)
from graph_exec.tune import Predicted, tune

CONFIGS = Path(__file__).parents[2] / "tests" / "data" / "configs"
MODELS = ("qwen2-vl-2b", "qwen2-vl-7b", "qwen2-vl-72b")
GIB = 2**30


def _kind(p: Predicted) -> str:
    c = p.candidate
    return "baseline" if c.schedule == "baseline" else f"mpipe {c.run_ahead}"


def rows(pps: list[int], dps: list[int], work: Workload) -> list[str]:
    """One markdown row per model, P, D and ZeRO: each schedule's smallest peak and its plan."""
    lines = [
        "| model | P | D | ZeRO | baseline | MPipe full | MPipe min | rank 0 parameters + optimizer, by hand |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        shape = model_shape(read_config(CONFIGS / name))
        costs = config_costs(shape, work)
        for pp in pps:
            for dp in dps:
                for zero in (False, True) if dp > 1 else (False,):
                    best: dict[str, Predicted] = {}
                    for p in tune(costs, pp, 2 * pp, None, splits=("even",), dp=dp, zero=zero):
                        best.setdefault(_kind(p), p)  # results come smallest peak first
                    cells = [_cell(best[kind]) for kind in ("baseline", "mpipe full", "mpipe min")]
                    hand = _by_hand(shape, work, best["baseline"], pp, dp if zero else 1)
                    zero_text = "on" if zero else "off"
                    lines.append(f"| {name} | {pp} | {dp} | {zero_text} | {' | '.join(cells)} | {hand} |")
    return lines


def _cell(p: Predicted) -> str:
    c = p.candidate
    return f"{p.max_peak / GIB:.1f} (V={c.vpp} M={c.micro}{' rc' if c.recompute else ''})"


def _by_hand(shape, work: Workload, p: Predicted, pp: int, shards: int) -> str:
    counts, e = param_counts(shape), DTYPE_BYTES[work.dtype]
    layers = sum(n for s, n in enumerate(p.layers) if s % pp == 0)
    trained = layers * (counts.layer + counts.layer_buffers) + counts.embedding + counts.unplaced
    held = trained + counts.vision
    per = 8 + (0 if e == 4 else 4)  # Adam's two float32 moments, and a float32 master copy
    optimizer = -(-trained * per // shards)
    if (held * e, optimizer) != (p.parts[0]["parameters"], p.parts[0]["optimizer"]):
        raise RuntimeError(f"{shape.family}: the hand count differs from tune's rank 0 figures")
    return f"{held:,} x {e} B + {trained:,} x {per} B / {shards} = {(held * e + optimizer) / GIB:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--pp", default="4,8")
    parser.add_argument("--dp", default="1,4")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--image-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    parser.add_argument("--attention", default="eager", choices=("eager", "flash"))
    args = parser.parse_args(argv)
    work = Workload(args.seq_len, args.image_tokens, args.dtype, args.attention)
    pps, dps = [int(x) for x in args.pp.split(",")], [int(x) for x in args.dp.split(",")]
    print("\n".join(rows(pps, dps, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
