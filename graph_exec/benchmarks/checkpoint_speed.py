"""Checkpoint cost on 2 ranks: save and load time, bytes per rank, and the share of training
time spent saving every 10 steps.

``python -m graph_exec.benchmarks.checkpoint_speed`` launches itself under msrun (2 local
ranks) and, per model (``vl_tower`` small, ``embed_lm`` tiny; MPipe, graph mode, V=2, M=4,
Adam), trains 2 warm-up steps, then ``ROUNDS`` rounds of: 10 training steps, one
:func:`graph_exec.save_checkpoint` (model and Adam state, pruning to the last 2 included),
one :func:`graph_exec.load_checkpoint` of it. Steps, saves and loads alternate in one run,
so machine noise hits them alike. Prints p10/p50/p90 per rank and the save overhead
``save p50 / (10 x step p50)``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from graph_exec.benchmarks.common import argument_parser, launch_and_report, p10_p50_p90

MODELS = (("vl_tower", "small"), ("embed_lm", "tiny"))
ROUNDS, EVERY, WARMUP = 6, 10, 2


def ms3(values: list[float]) -> str:
    p10, p50, p90 = p10_p50_p90(values)
    return f"{p10 * 1e3:7.1f} / {p50 * 1e3:7.1f} / {p90 * 1e3:7.1f} ms"


def _worker(root: Path) -> None:
    from mindspore.communication import get_rank, init

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    import graph_exec as ge
    from graph_exec.examples import load
    from graph_exec.harness.training import Trainer
    from graph_exec.report.job import JobSpec, RunSpec
    from graph_exec.transport import DeviceMesh, barrier

    rank = get_rank()
    mesh = DeviceMesh()
    ranks = mesh.pp_size
    for example, size in MODELS:
        folder = root / f"{example}-{size}"
        spec = RunSpec("bench", trainable=load(example).trainable_by_default)
        job = JobSpec(example, size, ranks, vpp=2, micro=4, batch=8, steps=0, warmup=0, runs=(spec,))
        trainer = Trainer(job, spec, mesh)
        index = 0
        for _ in range(WARMUP):
            trainer.step(index)
            index += 1
        steps, saves, loads, size_bytes = [], [], [], 0
        for _ in range(ROUNDS):
            for _ in range(EVERY):
                record = trainer.step(index)
                steps.append(record.end - record.start)
                index += 1
            barrier()
            saved = ge.save_checkpoint(trainer.schedule, folder, index, optimizer=trainer.optimizer)
            saves.append(saved.seconds)
            size_bytes = saved.bytes
            barrier()
            began = time.perf_counter()
            ge.load_checkpoint(trainer.schedule, folder, optimizer=trainer.optimizer)
            loads.append(time.perf_counter() - began)
        share = statistics.median(saves) / (EVERY * statistics.median(steps))
        print(
            f"RESULT {example} {size} rank {rank}: {size_bytes / 2**20:6.2f} MiB | step {ms3(steps)} | "
            f"save {ms3(saves)} | load {ms3(loads)} | save every {EVERY} steps: {share:6.1%} of training time",
            flush=True,
        )
    barrier()


def main(argv: list[str]) -> int:
    argument_parser(__doc__, "checkpoint_speed").parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        return launch_and_report(
            __file__,
            ["worker", root],
            nproc=2,
            timeout_s=900,
            heading=(
                f"checkpoint save/load, 2 ranks, MPipe graph mode V=2 M=4 batch 8, Adam; {ROUNDS} rounds of "
                f"{EVERY} steps + save + load; times p10 / p50 / p90 (a save waits for both ranks):"
            ),
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(Path(sys.argv[2]))
    else:
        sys.exit(main(sys.argv[1:]))
