"""Data parallel x pipeline parallel on 4 ranks: step time per layout, all-reduce time per bucket.

``python -m graph_exec.benchmarks.mesh_speed`` launches itself under msrun (4 local ranks,
each pinned to its share of the cores as ``graph-exec run`` does) and, in one job:

1. trains ``embed_lm`` tiny (trainable preprocess, MPipe, graph mode) on the layouts
   ``dp=1 x pp=4``, ``dp=2 x pp=2`` and ``dp=4 x pp=1``, step by step in turn so machine noise
   hits them alike. Every layout runs the same model (8 body chunks: ``V = 8 / pp``) on the
   same global batch of 32 sequences in micro-batches of 4 (``M = 8 / dp`` per replica).
   Step time: first rank into ``run()`` to last rank out of it, the optimizer step excluded;
2. averages a synthetic gradient set (48 tensors, 6.2 MiB) over all 4 ranks with
   :meth:`~graph_exec.transport.buckets.PackedTensors.average`, for each bucket size in turn,
   ``per tensor`` meaning one all-reduce per tensor.

Prints p10/p50/p90 over the measured steps (rounds) and each median's ratio to the first
row's. On a shared 2-core machine the absolute numbers are indicative only.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

from graph_exec.benchmarks.common import argument_parser, launch_and_report, p10_p50_p90

LAYOUTS = ((1, 4), (2, 2), (4, 1))  # (dp, pp)
STAGES, GLOBAL_BATCH, MICRO_ROWS = 8, 32, 4
WARMUP, STEPS = 2, 8
BUCKETS = (("per tensor", 1), ("64 KiB", 64 << 10), ("256 KiB", 256 << 10), ("1 MiB", 1 << 20))
BUCKETS += (("4 MiB", 4 << 20), ("16 MiB", 16 << 20))
ROUNDS = 15


def _layouts(rank: int) -> None:
    from graph_exec.harness.training import Trainer
    from graph_exec.report.job import JobSpec, RunSpec
    from graph_exec.transport import DeviceMesh, all_gather_objects

    base = JobSpec(
        example="embed_lm",
        size="tiny",
        ranks=4,
        vpp=1,
        micro=1,
        batch=GLOBAL_BATCH,
        steps=STEPS,
        warmup=WARMUP,
        runs=(RunSpec("mpipe", trainable=True),),
        timeout_s=300,
    )
    trainers = []
    for dp, pp in LAYOUTS:
        job = replace(base, dp=dp, vpp=STAGES // pp, micro=GLOBAL_BATCH // (dp * MICRO_ROWS))
        trainers.append(Trainer(job, job.runs[0], DeviceMesh(dp=dp, pp=pp)))
    spans: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(trainers))}
    for step in range(WARMUP + STEPS):
        for i, trainer in enumerate(trainers):
            record = trainer.step(step)
            if step >= WARMUP:
                spans[i].append((record.start, record.end))
    everyone = all_gather_objects(spans, 300, "gathering step times")
    dp_bytes = [t.schedule.stats().get("data_parallel") for t in trainers]
    if rank != 0:
        return
    rows = []
    for i, (dp, pp) in enumerate(LAYOUTS):
        steps = [max(r[i][k][1] for r in everyone) - min(r[i][k][0] for r in everyone) for k in range(STEPS)]
        rows.append((f"dp={dp} x pp={pp} (V={STAGES // pp}, M={GLOBAL_BATCH // (dp * MICRO_ROWS)})", steps))
    first = statistics.median(rows[0][1])
    for (name, steps), stats in zip(rows, dp_bytes, strict=True):
        p10, p50, p90 = p10_p50_p90(steps)
        extra = (
            "" if stats is None else f"  dp grads {stats.bytes / 1024:.0f} KiB in {stats.buckets} bucket(s)"
        )
        print(
            f"RESULT step  {name:<28} p10 {p10 * 1e3:7.1f}  p50 {p50 * 1e3:7.1f}  p90 {p90 * 1e3:7.1f} ms  "
            f"ratio {p50 / first:5.2f}{extra}",
            flush=True,
        )


def _buckets(rank: int) -> None:
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter

    from graph_exec.transport import DeviceMesh, Transport, barrier
    from graph_exec.transport.buckets import PackedTensors

    mesh = DeviceMesh(dp=4, pp=1)
    group = Transport(timeout_s=300, group=mesh.dp)
    rng = np.random.default_rng(rank)
    shapes = [(256, 256), (256,)] * 24
    grads = [
        Parameter(ms.Tensor(rng.standard_normal(s).astype(np.float32)), name=f"g{i}")
        for i, s in enumerate(shapes)
    ]
    total = sum(int(g.nbytes) for g in grads)
    averages = [(name, PackedTensors(grads, size)) for name, size in BUCKETS]
    times: dict[str, list[float]] = {name: [] for name, _ in BUCKETS}
    for _ in range(ROUNDS):
        for name, average in averages:
            barrier()
            start = time.perf_counter()
            average.average(group)
            for g in grads:
                g.asnumpy()  # wait for the copies back
            times[name].append(time.perf_counter() - start)
    if rank != 0:
        return
    first = statistics.median(times[BUCKETS[0][0]])
    for name, average in averages:
        p10, p50, p90 = p10_p50_p90(times[name])
        print(
            f"RESULT allreduce  bucket {name:<10} ({len(average.buckets):>2} calls for {total / 2**20:.1f} MiB)  "
            f"p10 {p10 * 1e3:7.2f}  p50 {p50 * 1e3:7.2f}  p90 {p90 * 1e3:7.2f} ms  ratio {p50 / first:5.2f}",
            flush=True,
        )


def _worker() -> None:
    from graph_exec.harness.worker import pin_cores

    pin_cores(4)
    from mindspore.communication import get_rank, init

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    rank = get_rank()
    _buckets(rank)
    _layouts(rank)


def main(argv: list[str]) -> int:
    argument_parser(__doc__, "mesh_speed").parse_args(argv)
    return launch_and_report(
        __file__,
        ["worker"],
        nproc=4,
        timeout_s=1500,
        ranks=[0],
        heading=(
            f"4 ranks on this machine, loopback; p10/p50/p90 over {ROUNDS} rounds (all-reduce) and "
            f"{STEPS} measured steps after {WARMUP} warm-up (layouts); ratio = p50 / first row's p50"
        ),
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        _worker()
    else:
        sys.exit(main(sys.argv[1:]))
