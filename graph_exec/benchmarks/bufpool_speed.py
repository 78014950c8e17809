"""Buffer pool and slot planner speed.

Measures, in one process and side by side (the cases alternate every repeat, so machine noise
hits all of them alike), for a few buffer sizes:

* ``pool pair``: ``acquire`` + ``release`` of a block, the pool's own cost;
* ``pool tensor``: acquire + ``view`` + ``mindspore.from_numpy`` + release, what a receive does;
* ``fresh tensor``: ``numpy.empty`` + ``mindspore.from_numpy``, what the pool replaces;
* the last two again with a write of the whole buffer (as a receive does), where fresh memory
  may also pay page faults;

and the slot planner's time for 100 000 random lifetimes, from Python (conversions included).

Run ``python -m graph_exec.benchmarks.bufpool_speed``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from graph_exec.bufpool import BufferPool, plan_slots

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20}


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _alternate(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each case's result, the cases interleaved repeat by repeat."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: statistics.median(values) for name, values in samples.items()}


def _allocation_cases(ms, nbytes: int) -> dict[str, Callable[[], object]]:
    pool = BufferPool()
    count = nbytes // 4

    def pool_pair() -> None:
        pool.release(pool.acquire(nbytes))

    def pool_tensor(fill: bool = False) -> None:
        block = pool.acquire(nbytes)
        view = block.view(np.float32, count)
        tensor = ms.from_numpy(view)
        if fill:
            view.fill(1.0)
        del tensor, view
        pool.release(block)

    def fresh_tensor(fill: bool = False) -> None:
        array = np.empty(count, np.float32)
        tensor = ms.from_numpy(array)
        if fill:
            array.fill(1.0)
        del tensor

    return {
        "pool pair": pool_pair,
        "pool tensor": pool_tensor,
        "fresh tensor": fresh_tensor,
        "pool tensor+write": lambda: pool_tensor(fill=True),
        "fresh tensor+write": lambda: fresh_tensor(fill=True),
    }


def _random_lifetimes(
    count: int, max_len: int, sizes: Callable[[random.Random], int]
) -> list[tuple[int, int, int]]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        first = rng.randrange(count)
        out.append((first, first + rng.randrange(max_len), sizes(rng)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lifetimes", type=int, default=100_000)
    args = parser.parse_args(argv)

    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    ms.set_device("CPU")
    ms.runtime.launch_blocking()

    print("microseconds per call (median of repeats); x = fresh time / pool time")
    print(
        f"{'size':>7} {'pool pair':>10} {'pool tensor':>12} {'fresh tensor':>13} {'x pair':>7}"
        f" {'x tensor':>9}  | {'pool+write':>11} {'fresh+write':>12} {'x':>6}"
    )
    for label, nbytes in SIZES.items():
        cases = _allocation_cases(ms, nbytes)
        for fn in cases.values():  # warm up: first allocations, MindSpore lazy init
            fn()
        # Enough calls that the caches a previous case evicted do not dominate; writes cost more.
        calls = {
            name: max(10, min(2000, (64 << 20) // nbytes)) if "write" in name else 2000 for name in cases
        }
        us = _alternate(
            {name: lambda fn=fn, n=calls[name]: _per_call_us(fn, n) for name, fn in cases.items()},
            args.repeats,
        )
        fresh, fresh_w = us["fresh tensor"], us["fresh tensor+write"]
        print(
            f"{label:>7} {us['pool pair']:10.2f} {us['pool tensor']:12.2f} {fresh:13.2f}"
            f" {fresh / us['pool pair']:7.1f} {fresh / us['pool tensor']:9.2f}"
            f"  | {us['pool tensor+write']:11.1f} {fresh_w:12.1f} {fresh_w / us['pool tensor+write']:6.2f}"
        )

    workloads = {
        "random sizes 1 B-64 MiB": lambda r: r.randint(1, 64 << 20),
        "8 sizes 4 KiB-512 KiB": lambda r: 4096 << r.randrange(8),
    }
    print(f"\nslot planner, {args.lifetimes} lifetimes of 1-64 steps starting in [0, {args.lifetimes}):")
    for label, sizes in workloads.items():
        lifetimes = _random_lifetimes(args.lifetimes, 64, sizes)
        timings, plan = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = plan_slots(lifetimes)
            timings.append(time.perf_counter() - start)
        print(
            f"  {label:<24} median {statistics.median(timings) * 1e3:6.1f} ms (min {min(timings) * 1e3:.1f}),"
            f" {len(plan.slot_sizes)} slots, total / peak = {plan.total_bytes / plan.peak_bytes:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
