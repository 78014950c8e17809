"""What ZeRO-1 (``optimizer_sharding=True``) costs and saves at dp = 2.

``python -m graph_exec.benchmarks.zero_cost`` launches itself under msrun (2 local ranks, each
pinned to its share of the cores as ``graph-exec run`` does, ``dp=2 x pp=1``) and trains
``llama`` small (graph mode, Adam) twice in one job, without and with sharding, step by step in
turn so machine noise hits both alike. Step time here is ``run()`` *and* ``step()`` (the
optimizer and, sharded, the broadcast of each owner's new values): first rank into ``run()``
to last rank out of ``step()``. Prints p10/p50/p90 over the measured steps, the time of the
broadcasts alone (sharded), and each rank's optimizer-state bytes and parameter bytes.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from graph_exec.benchmarks.common import argument_parser, launch_and_report, p10_p50_p90

WARMUP, STEPS = 2, 8


def _measure(rank: int) -> None:
    from graph_exec.harness.training import Trainer
    from graph_exec.report.job import JobSpec, RunSpec
    from graph_exec.transport import DeviceMesh, all_gather_objects

    job = JobSpec(
        example="llama",
        size="small",
        ranks=2,
        dp=2,
        vpp=2,
        micro=2,
        batch=8,
        steps=STEPS,
        warmup=WARMUP,
        runs=(
            RunSpec("unsharded", trainable=True),
            RunSpec("zero1", trainable=True, optimizer_sharding=True),
        ),
        timeout_s=300,
    )
    mesh = DeviceMesh(dp=2, pp=1)
    trainers = [Trainer(replace(job, runs=(spec,)), spec, mesh) for spec in job.runs]
    spans: list[list[tuple[float, float]]] = [[] for _ in trainers]
    for step in range(WARMUP + STEPS):
        for i, trainer in enumerate(trainers):
            record = trainer.step(step)  # run() then step(): the record starts at run()
            if step >= WARMUP:
                spans[i].append((record.start, time.perf_counter()))
    facts = [(t.schedule.stats()["memory"], t.schedule.stats().get("optimizer_sharding")) for t in trainers]
    everyone = all_gather_objects((spans, facts), 300, "gathering step times")
    if rank != 0:
        return
    for i, spec in enumerate(job.runs):
        steps = [
            max(r[0][i][k][1] for r in everyone) - min(r[0][i][k][0] for r in everyone) for k in range(STEPS)
        ]
        p10, p50, p90 = p10_p50_p90(steps)
        print(
            f"RESULT step  {spec.name:<10} p10 {p10 * 1e3:7.1f}  p50 {p50 * 1e3:7.1f}  p90 {p90 * 1e3:7.1f} ms",
            flush=True,
        )
        for r, (_, rank_facts) in enumerate(everyone):
            memory, sharding = rank_facts[i]
            gather = (
                ""
                if sharding is None
                else f", broadcast of new values {sharding.gather_seconds / sharding.gathers * 1e3:.1f} ms/step "
                f"({sharding.gather_bytes / 2**20:.2f} MiB), owns {sharding.owned_parameters}/{sharding.parameters}"
            )
            print(
                f"RESULT bytes {spec.name:<10} rank {r}: optimizer state {memory['optimizer_state'] / 2**20:.2f} MiB, "
                f"parameters {memory['parameters'] / 2**20:.2f} MiB{gather}",
                flush=True,
            )


def _worker() -> None:
    from graph_exec.harness.worker import pin_cores

    pin_cores(2)
    from mindspore.communication import get_rank, init

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    _measure(get_rank())


def main(argv: list[str]) -> int:
    argument_parser(__doc__, "zero_cost").parse_args(argv)
    return launch_and_report(
        __file__,
        ["worker"],
        nproc=2,
        timeout_s=900,
        ranks=[0],
        heading=(
            f"2 ranks (dp=2 x pp=1) on this machine, loopback; llama small, graph mode, Adam; p10/p50/p90 "
            f"over {STEPS} measured steps after {WARMUP} warm-up, run() and step() together"
        ),
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        _worker()
    else:
        sys.exit(main(sys.argv[1:]))
