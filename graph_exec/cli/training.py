"""Worker side of ``graph-exec run`` and ``bench``: train each run of a job and record it.

Runs under msrun (see :mod:`graph_exec.cli.worker`). Every rank builds the whole example model
with the job's seed, keeps its own chunks (``rank, rank + P, …``) and trains with Adam. Each
step starts after a barrier, so all ranks begin it together and its span on the shared
monotonic clock is the pipeline's step time. Every rank prints one progress line per step
(prefix :data:`~graph_exec.report.job.PROGRESS`; the parent echoes the last-stage rank's, which
carry the loss, and names a dead rank's last step from its own); every rank writes a
:class:`~graph_exec.report.records.RankRecord` per run at the end.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import mindspore as ms
from mindspore import nn

import graph_exec as ge
from graph_exec.cli.status import CompileWatch, announce
from graph_exec.errors import GraphExecError
from graph_exec.examples import load
from graph_exec.examples.common import ExampleModel
from graph_exec.executors import create_executor
from graph_exec.kernels import as_tuple, make_stage_forward
from graph_exec.msenv import wait_for
from graph_exec.report.job import PROGRESS, JobSpec, RunSpec
from graph_exec.report.records import Event, RankRecord, StepRecord
from graph_exec.transport import barrier

#: Repeats of the dispatch calibration (hook call and bare kernel call, alternated).
CALIBRATION_REPEATS = 25


def nbytes(tensors: Sequence[Any]) -> int:
    return sum(int(t.nbytes) for t in tensors)


class Trainer:
    """One run of a job on this rank: its model, schedule, optimizer and measurements."""

    def __init__(self, job: JobSpec, spec: RunSpec, rank: int, ranks: int) -> None:
        self.job, self.spec, self.rank, self.ranks = job, spec, rank, ranks
        self.num_stages = ranks * job.vpp
        self.model: ExampleModel = load(job.example).build(
            self.num_stages, trainable_preprocess=spec.trainable, seed=job.seed, size=job.size
        )
        self.chunks = self.model.baseline_stages() if spec.baseline else self.model.stages
        self.local = list(range(rank, self.num_stages, ranks))
        stages = [ge.PipelineStage(self.chunks[s], s, self.num_stages) for s in self.local]
        common: dict[str, Any] = {
            "mode": spec.mode,
            "loss_fn": self.model.loss_fn,
            "timeout_s": job.timeout_s,
            "sync_steps": True,  # honest per-step times on any device (the CPU default anyway)
        }
        if spec.baseline:
            self.schedule = ge.ScheduleInterleaved1F1B(stages, job.micro, **common)
        else:
            self.schedule = ge.ScheduleMPipeTranspose(
                stages,
                job.micro,
                self.model.preprocess,
                self.model.num_transpose_layers,
                overflow=spec.overflow,
                backward=spec.backward,
                **common,
            )
        self.optimizer: Callable[..., Any] | None = None
        self.records: list[StepRecord] = []

    def step(self, index: int) -> StepRecord:
        """One training step: barrier, ``run()``, optimizer; returns (and keeps) its record."""
        inputs, labels = self.model.batch(index, self.job.batch)
        barrier()
        start = time.perf_counter()
        losses = self.schedule.run(*inputs, labels=labels)
        end = time.perf_counter()
        timeline = self.schedule.timeline
        # The first run() sets up communication and the plan before the runtime's clock starts:
        # anchor that step's timeline at its end instead of its start.
        origin = start if self.records or not timeline else end - timeline[-1].end
        loss = None if losses is None else statistics.fmean(float(x.asnumpy()) for x in losses)
        self._update()
        stats = self.schedule.stats()
        record = StepRecord(
            step=index,
            start=start,
            end=end,
            events=tuple(Event(e.step, origin + e.start, origin + e.end) for e in timeline),
            loss=loss,
            compilations=stats["compilations"],
            compile_seconds=stats["compile_seconds"],
            allocations=stats["pool"].allocations,
        )
        self.records.append(record)
        # Every rank says which step it finished (a failure report names a dead rank's last
        # step); the parent echoes the last-stage rank's lines, which carry the loss.
        line = {"run": self.spec.name, "step": index, "loss": loss, "seconds": end - start}
        print(PROGRESS + json.dumps(line), flush=True)
        return record

    def _update(self) -> None:
        params = self.schedule.trainable_params()
        if self.optimizer is None:
            self.optimizer = nn.Adam(params, learning_rate=self.job.lr)
        grads = self.schedule.grads()
        self.optimizer(tuple(grads[p.name] for p in params))
        self.schedule.zero_grad()

    def finish(self, run_dir: Path) -> RankRecord:
        """Write this rank's record of the run (with transfer sizes and dispatch if asked)."""
        activation = preprocess = 0
        dispatch = None
        if self.job.calibrate:
            inputs = self._stage_inputs()
            preprocess = 0 if self.spec.baseline else nbytes(inputs[0])
            activation = nbytes(inputs[1]) if self.num_stages > 1 else 0
            dispatch = self._dispatch_seconds(inputs)
        record = RankRecord(
            self.spec.name,
            self.rank,
            self.ranks,
            tuple(self.records),
            activation_bytes=activation,
            preprocess_bytes=preprocess,
            dispatch_seconds=dispatch,
        )
        record.write(run_dir)
        return record

    # -- calibration ---------------------------------------------------------------------------

    def _stage_inputs(self) -> list[tuple[Any, ...]]:
        """Micro-batch 0's input of every stage but the last, computed eagerly on this rank."""
        inputs, _ = self.model.batch(0, self.job.batch)
        rows = self.job.batch // self.job.micro
        x = tuple(t[:rows] for t in inputs)
        if not self.spec.baseline:
            x = as_tuple(self.model.preprocess(*x))
        out = [x]
        for chunk in self.chunks[:-1]:
            out.append(as_tuple(chunk(*out[-1])))
        return out

    def _dispatch_seconds(self, inputs: list[tuple[Any, ...]]) -> float | None:
        """What a hook call costs beyond its kernel, on this rank's first non-last chunk.

        An executor built exactly like the schedule's (same chunks, same preprocess, so the
        same parameters to watch) runs ``stage_forward`` through its hook and, alternately,
        the very same kernel called bare (compiled the same way in graph mode). Both wait for
        the outputs. The difference of the medians is the per-call cost of the hook path:
        signature, cache lookup, parameter-storage check and bookkeeping.
        """
        stage = next((s for s in self.local if s != self.num_stages - 1), None)
        if stage is None:
            return None
        chunks = {s: self.chunks[s] for s in self.local}
        executor = create_executor(
            self.spec.mode,
            chunks,
            preprocess=None if self.spec.baseline else self.model.preprocess,
            loss_fn=self.model.loss_fn,
            last_stage=self.num_stages - 1,
        )
        kernel = make_stage_forward(chunks[stage])
        bare = ms.jit(kernel) if self.spec.mode == "graph" else kernel
        x = inputs[stage]

        def hook() -> float:
            begin = time.perf_counter()
            wait_for(executor.stage_forward(stage, 0, x))
            elapsed = time.perf_counter() - begin
            executor.drop_kept()
            return elapsed

        def direct() -> float:
            begin = time.perf_counter()
            wait_for(bare(*x))
            return time.perf_counter() - begin

        for _ in range(3):
            hook(), direct()
        hooked, bared = [], []
        for _ in range(CALIBRATION_REPEATS):
            hooked.append(hook())
            bared.append(direct())
        return max(0.0, statistics.median(hooked) - statistics.median(bared))


def train(job: JobSpec, run_dir: Path, rank: int, ranks: int) -> None:
    """Every run of ``job``, interleaved step by step so machine noise hits all runs alike."""
    trainers = [Trainer(job, spec, rank, ranks) for spec in job.runs]

    def compiled() -> tuple[int, float]:
        graphs, seconds = 0, 0.0
        for trainer in trainers:
            try:
                stats = trainer.schedule.stats()
            except GraphExecError:  # its first run() has not set it up yet
                continue
            graphs, seconds = graphs + stats["compilations"], seconds + stats["compile_seconds"]
        return graphs, seconds

    for index in range(job.total_steps):
        with CompileWatch(compiled) if index == 0 else nullcontext():  # the first step compiles
            for trainer in trainers:
                trainer.step(index)
    announce("finishing")
    for trainer in trainers:
        trainer.finish(run_dir)
