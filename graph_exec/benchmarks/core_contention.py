"""What running on both cores at once costs each of them: the tower's forward alone against the
same forward while the other core runs it too.

MPipe takes work off rank 0 by running it on another rank *at the same time* (rank 1's towers
during rank 0's own, at the start of a step). On a machine with one device per rank that is
free; on a 2-core CPU machine both ranks share the memory system and whatever the host's
virtual CPUs share, so work that overlaps may run slower than the same work alone. The
simulator, fed with costs measured inside one launch, cannot tell the two apart; this script
measures the difference directly.

``python -m graph_exec.benchmarks.core_contention [--depth D] [--rows N] [--calls C] [--runs R]``
(default: the tiny ``qwen2vl`` vision tower with 11 blocks, the depth ``graph-exec bench qwen2vl
--tower-ratio 2`` builds here, on 2 rows, the rows of one micro-batch; 30 calls; three runs)
starts two processes, each bound to its own core like a rank, each with the tower compiled
(``mindspore.jit``, as the frozen tower runs). Each run has ``C`` rounds of three phases,
separated by barriers (a waiting process sleeps): process 0 calls the tower once while process
1 waits, both call it at once, process 1 calls it alone. It prints p10/p50/p90 of a call in
each phase and, per process, the p50 ratio ``together / alone`` (1.00: the cores do not slow
each other).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from graph_exec.benchmarks.common import p10_p50_p90

#: Which process calls the tower in each phase of a round.
PHASES = (("0 alone", (0,)), ("together", (0, 1)), ("1 alone", (1,)))


def _worker(index: int, core: int, depth: int, rows: int, calls: int, barrier: Any, results: Any) -> None:
    os.sched_setaffinity(0, {core})  # before MindSpore starts its threads, as a rank is bound
    import mindspore as ms

    from graph_exec.device import wait_for
    from graph_exec.examples import qwen2vl
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    model = qwen2vl.build(4, size="tiny", vision_depth=depth)
    inputs, _ = model.batch(0, rows)
    tower = ms.jit(model.preprocess)

    def call() -> float:
        begin = time.perf_counter()
        wait_for(tower(*inputs))
        return time.perf_counter() - begin

    for _ in range(3):  # the first compiles
        call()
    timings: dict[str, list[float]] = {phase: [] for phase, active in PHASES if index in active}
    for _ in range(calls):  # in rounds: a slow spell of the machine hits every phase alike
        for phase, active in PHASES:
            barrier.wait()
            if index in active:
                timings[phase].append(call())
        barrier.wait()
    results.put((index, timings))


def measure(depth: int, rows: int, calls: int) -> dict[int, dict[str, list[float]]]:
    """One run: both processes' call times per phase (seconds)."""
    import multiprocessing

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(
            f"core_contention needs two cores to bind its processes to, this process has {cores}"
        )
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2, timeout=600), context.Queue()
    workers = [
        context.Process(target=_worker, args=(i, cores[i], depth, rows, calls, barrier, results))
        for i in range(2)
    ]
    for worker in workers:
        worker.start()
    collected = dict(results.get(timeout=900) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    if any(worker.exitcode != 0 for worker in workers):
        raise SystemExit(f"a worker failed: exit codes {[worker.exitcode for worker in workers]}")
    return collected


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graph_exec.benchmarks.core_contention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--depth", type=int, default=11, help="vision blocks of the tower (default 11)")
    parser.add_argument("--rows", type=int, default=2, help="rows per call (default 2: one micro-batch)")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per phase (default 30)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each with fresh processes (default 3)")
    args = parser.parse_args(argv)
    for name in ("depth", "rows", "calls", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")

    def ms(values: list[float]) -> str:
        return "/".join(f"{v * 1e3:.2f}" for v in p10_p50_p90(values))

    print(
        f"qwen2vl tiny tower, {args.depth} blocks, {args.rows} rows, compiled; p10/p50/p90 ms of "
        f"{args.calls} calls per phase, each process bound to its own core",
        flush=True,
    )
    for run in range(1, args.runs + 1):
        timings = measure(args.depth, args.rows, args.calls)
        ratios = [
            statistics.median(timings[i]["together"]) / statistics.median(timings[i][f"{i} alone"])
            for i in (0, 1)
        ]
        print(
            f"run {run}/{args.runs}: process 0 alone {ms(timings[0]['0 alone'])}, together "
            f"{ms(timings[0]['together'])}; process 1 alone {ms(timings[1]['1 alone'])}, together "
            f"{ms(timings[1]['together'])}; together/alone {ratios[0]:.2f} and {ratios[1]:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
