"""Worker side of ``graph-exec run`` and ``bench``: train each run of a job and record it.

Runs under msrun (see :mod:`graph_exec.harness.worker`). The ranks form a
:class:`~graph_exec.DeviceMesh` of ``dp`` pipeline replicas; every rank builds the whole example
model with the job's seed, keeps its own chunks (``p, p + P, …`` for pipeline rank ``p``),
trains on its replica's share of the global batch and steps Adam on the replica-averaged
gradients. Each step starts after a barrier, so all ranks begin it together and its span on the
shared monotonic clock is the job's step time. Every rank prints one progress line per step
(prefix :data:`~graph_exec.report.job.PROGRESS`; the parent echoes those of replica 0's last
stage, which carry the loss averaged over the replicas, and names a dead rank's last step from
its own); every rank writes a :class:`~graph_exec.report.records.RankRecord` per run at the end
(on several hosts, every host gets every rank's record). A job with a checkpoint directory
loads its ``first_step`` checkpoint before training and saves (schedule and Adam state,
:func:`graph_exec.save_checkpoint`) every ``save_every`` steps and after the last one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

import graph_exec as ge
from graph_exec.checkpoint import SavedCheckpoint
from graph_exec.data import DataLoader
from graph_exec.device import wait_for
from graph_exec.errors import GraphExecError
from graph_exec.examples import load
from graph_exec.examples.common import ExampleModel
from graph_exec.executors import create_executor
from graph_exec.report.job import PROGRESS, JobSpec, RunSpec
from graph_exec.report.records import Event, RankRecord, StepRecord
from graph_exec.report.status import CompileWatch, announce
from graph_exec.transport import DeviceMesh, Transport, all_gather_objects, barrier, bound_backend_waits

#: Repeats of the dispatch calibration (hook call and bare kernel call, alternated).
CALIBRATION_REPEATS = 25

#: ``data="shuffled"``: the data set holds this many global batches (one epoch), so a run of a
#: few steps crosses epochs and reshuffles.
EPOCH_STEPS = 3


def nbytes(tensors: Sequence[Any]) -> int:
    return sum(int(t.nbytes) for t in tensors)


class Trainer:
    """One run of a job on this rank: its model, schedule, optimizer and measurements."""

    def __init__(self, job: JobSpec, spec: RunSpec, mesh: DeviceMesh) -> None:
        self.job, self.spec, self.mesh = job, spec, mesh
        self.rank, self.ranks = mesh.global_rank, mesh.dp_size * mesh.pp_size
        pp = mesh.pp_size
        self.num_stages = pp * job.vpp
        options = {**(job.model_options or {}), **({"layers": spec.layers} if spec.layers else {})}
        if spec.pack_balance is not None:
            options["pack_balance"] = spec.pack_balance
        longest = max(job.seq_len_range or (0, 0))
        if longest:  # positions and the causal mask must reach the longest sequence
            options["max_seq"] = max(longest, *(job.shape_buckets or (0,)))
        if options.get("pretrained"):  # each rank reads only its own share of the directory
            options.update(rank=mesh.pp_rank, pp=pp)
        self.model: ExampleModel = load(job.example).build(
            self.num_stages, trainable_preprocess=spec.trainable, seed=job.seed, size=job.size, **options
        )
        self.chunks = self.model.stages
        self.local = list(range(mesh.pp_rank, self.num_stages, pp))
        self.rows = job.batch // mesh.dp_size  # this replica's share of the global batch
        self._input_fields = 0  # data="shuffled": how many leading fields of a sample are inputs
        self.loader = self._data_loader() if job.data == "shuffled" else None
        self._samples: list[int] | None = None  # the source indices of the last step's batch
        stages = [ge.PipelineStage(self.chunks[s], s, self.num_stages) for s in self.local]
        bucketed = job.shapes == "buckets"
        # The per-token mean of real-data examples (the bucketed loss takes masks; a shuffled
        # loader's labels are the data set's own): then each micro-batch's labelled tokens weigh it.
        self._token_loss = self.model.token_loss and not bucketed and self.loader is None
        common: dict[str, Any] = {
            "mode": spec.mode,
            "loss_fn": self.model.masked_loss_fn if bucketed else self.model.loss_fn,
            **(_token_loss_options() if self._token_loss else {}),
            "shapes": job.shapes,
            **({"shape_buckets": {1: job.shape_buckets}} if bucketed else {}),
            "timeout_s": job.timeout_s,
            "body": spec.body,
            "recompute": spec.recompute,
            "measure_tape": spec.measure_tape,
            "sync_steps": True,  # honest per-step times on any device (the CPU default anyway)
            "mesh": mesh,
            "optimizer_sharding": spec.optimizer_sharding,
            # a tied embedding and head stay one weight (an export writes the embedding only)
            "tied_parameters": getattr(self.model.split, "tied_weights", None),
        }
        if spec.baseline:  # the fair baseline: the same preprocess on rank 0, not transposed
            self.schedule = ge.ScheduleInterleaved1F1B(
                stages, job.micro, self.model.preprocess, self.model.num_transpose_layers, **common
            )
        else:
            self.schedule = ge.ScheduleMPipeTranspose(
                stages,
                job.micro,
                self.model.preprocess,
                self.model.num_transpose_layers,
                run_ahead=spec.run_ahead,
                backward=spec.backward,
                keep_preprocess_tape=spec.keep_preprocess_tape,
                tower_order=spec.tower_order,
                **common,
            )
        # Built now, not at the first update: a resumed job loads its state before any step.
        self.optimizer = nn.Adam(self.schedule.optimizer_params(), learning_rate=job.lr)
        self.records: list[StepRecord] = []
        # The last-stage ranks of all replicas form one data-parallel group: average the loss there.
        self._loss_group = (
            Transport(timeout_s=job.timeout_s, group=mesh.dp)
            if self.holds_loss and mesh.dp_size > 1
            else None
        )

    @property
    def holds_loss(self) -> bool:
        return self.local[-1] == self.num_stages - 1

    def step(self, index: int) -> StepRecord:
        """One training step: barrier, ``run()``, optimizer; returns (and keeps) its record.

        Prints nothing: :meth:`report` announces the step once a checkpoint due after it is written.
        """
        if self.model.micro_batches is not None and self.loader is None:
            # Each micro-batch padded to its own sizes: run() takes them as they are.
            batches = self._replica_micro_batches(index)
            data = {"micro_batches": batches, "tower_costs": self._tower_costs_of(batches)}
            inputs: tuple[Any, ...] = ()
            self._label_counts = [_labelled(labels) for _, labels in batches]
        else:
            inputs, labels = self._replica_batch(index) if self.loader is None else self._loaded_batch(index)
            data = {"labels": labels, "tower_costs": self._tower_costs(inputs)}
            if self._token_loss:
                self._label_counts = [_labelled(part) for part in np.split(labels.asnumpy(), self.job.micro)]
        barrier(timeout_s=self.job.timeout_s)  # a rank that hangs before the step is named
        start = time.perf_counter()
        losses = self.schedule.run(*inputs, **data)
        end = time.perf_counter()
        timeline = self.schedule.timeline
        # The first run() sets up communication and the plan before the runtime's clock starts:
        # anchor that step's timeline at its end instead of its start.
        origin = start if self.records or not timeline else end - timeline[-1].end
        loss = None if losses is None else self._mean_loss(losses)
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
        return record

    def report(self, record: StepRecord, saved: SavedCheckpoint | None) -> None:
        """The progress line of a step, with the checkpoint written after it (every rank prints
        one, so a failure report can name a dead rank's last step; the parent echoes the lines of
        replica 0's last stage, which carry the loss)."""
        line: dict[str, Any] = {
            "run": self.spec.name,
            "step": record.step,
            "loss": record.loss,
            "seconds": record.end - record.start,
        }
        before = self.records[-2] if len(self.records) > 1 else None
        compiled = record.compilations - (before.compilations if before else 0)
        if compiled:  # said in the step line: a new shape (shapes="dynamic") costs seconds
            seconds = record.compile_seconds - (before.compile_seconds if before else 0.0)
            line["compiled"] = {"graphs": compiled, "seconds": seconds, "first": before is None}
        if self._samples is not None:
            line["samples"] = self._samples
        counts = self.model.token_counts(record.step, self.job.batch) if self.model.token_counts else None
        if counts is not None:  # the global batch's (real, padded) tokens
            line["tokens"] = {"real": counts[0], "padded": counts[1]}
        spread_of = getattr(self.model, "tower_spread", None)  # an ExampleModel's, or absent
        tower = spread_of(record.step, self.job.batch) if spread_of else None
        if tower is not None:  # packed rows: the micro-batches' tower costs, max/mean
            line["tower_spread"] = tower
        if saved is not None:
            line["checkpoint"] = {
                "path": str(saved.path),
                "seconds": saved.seconds,
                "bytes": saved.total_bytes,
            }
        print(PROGRESS + json.dumps(line), flush=True)

    def save(self, steps_done: int) -> SavedCheckpoint:
        """Checkpoint the schedule and the optimizer after ``steps_done`` steps (every rank)."""
        return ge.save_checkpoint(
            self.schedule,
            self._checkpoint_dir(),
            steps_done,
            optimizer=self.optimizer,
            data=self.loader,
            global_batch=self.job.batch,
            job={"layers": list(self.spec.layers) if self.spec.layers else None},
        )

    def resume(self, steps_done: int) -> None:
        """Load the checkpoint of step ``steps_done`` before training on (every rank).

        Says so first: a load that fails is then reported as failing in step ``steps_done + 1``
        (:func:`graph_exec.cli.jobs.steps_finished`), not in the first step.
        """
        print(PROGRESS + json.dumps({"run": self.spec.name, "resuming": steps_done}), flush=True)
        began = time.perf_counter()
        ge.load_checkpoint(
            self.schedule,
            self._checkpoint_dir(),
            optimizer=self.optimizer,
            step=steps_done,
            data=self.loader,
            global_batch=self.job.batch,
        )
        line = {"run": self.spec.name, "resumed": steps_done, "seconds": time.perf_counter() - began}
        print(PROGRESS + json.dumps(line), flush=True)

    def _checkpoint_dir(self) -> Path:
        if self.job.checkpoint_dir is None:
            raise ValueError("this job has no checkpoint directory")
        return Path(self.job.checkpoint_dir)

    def _replica_batch(self, index: int) -> tuple[tuple[Any, ...], Any]:
        """This replica's rows of step ``index``'s global batch (all of it without dp)."""
        length = None
        if self.job.seq_len_range is not None:  # the same draw on every rank: seeded by the step
            low, high = self.job.seq_len_range
            length = int(np.random.default_rng((self.job.seed, index)).integers(low, high + 1))
        inputs, labels = self.model.batch(index, self.job.batch, length)
        if self.mesh.dp_size == 1:
            return inputs, labels
        mine = slice(self.mesh.dp_rank * self.rows, (self.mesh.dp_rank + 1) * self.rows)
        cut = tuple(t[mine] for t in inputs)
        return cut, (tuple(t[mine] for t in labels) if isinstance(labels, tuple | list) else labels[mine])

    def _data_loader(self) -> DataLoader:
        """``data="shuffled"``: the example's samples of :data:`EPOCH_STEPS` global batches as a
        data set, each replica reading its shard through :class:`graph_exec.data.DataLoader`."""
        inputs, labels = self.model.batch(0, EPOCH_STEPS * self.job.batch)
        self._input_fields = len(inputs)
        fields = [
            t.asnumpy() for t in (*inputs, *(labels if isinstance(labels, tuple | list) else (labels,)))
        ]
        samples = [tuple(field[row] for field in fields) for row in range(len(fields[0]))]
        return DataLoader(samples, self.rows, mesh=self.mesh, shuffle=True, seed=self.job.seed)

    def _loaded_batch(self, index: int) -> tuple[tuple[Any, ...], Any]:
        """The loader's next batch, which must be step ``index``'s (a resumed loader is moved to it)."""
        loader = self.loader
        at = loader.epoch * len(loader) + loader.step
        if at != index:
            raise RuntimeError(f"the data loader is at global step {at}, the training at step {index}")
        self._samples = [int(i) for i in loader.next_indices()]
        fields = [ms.Tensor(f) for f in loader.next_batch()]
        inputs, labels = tuple(fields[: self._input_fields]), fields[self._input_fields :]
        return inputs, labels[0] if len(labels) == 1 else tuple(labels)

    def _replica_micro_batches(self, index: int) -> list[tuple[tuple[Any, ...], Any]]:
        """Step ``index``'s micro-batches, each padded to its own sizes (the example's
        ``micro_batches``): with dp > 1 this replica's, where the example makes each replica's
        own (packed rows: ``shards_micro_batches``); otherwise one pipeline only, since a
        replica's share would be cut after padding."""
        if self.mesh.dp_size == 1:
            return self.model.micro_batches(index, self.job.batch, self.job.micro)
        if not self.model.shards_micro_batches:
            raise ValueError(
                f"run {self.spec.name}: micro-batches padded each to its own sizes need dp = 1, "
                f"got dp = {self.mesh.dp_size}"
            )
        return self.model.micro_batches(
            index, self.job.batch, self.job.micro, replica=self.mesh.dp_rank, replicas=self.mesh.dp_size
        )

    def _tower_costs(self, inputs: Sequence[Any]) -> tuple[float, ...] | None:
        """Each micro-batch's tower cost for ``tower_order="balanced"``, from the batch itself
        (replicated input: every rank holds the same batch, so reaches the same placement)."""
        if not self._places_towers():
            return None
        return self.model.tower_costs(inputs, self.job.micro)

    def _tower_costs_of(self, batches: Sequence[tuple[Sequence[Any], Any]]) -> tuple[float, ...] | None:
        """:meth:`_tower_costs` of micro-batches given one by one."""
        if not self._places_towers():
            return None
        return tuple(self.model.tower_costs(inputs, 1)[0] for inputs, _ in batches)

    def _places_towers(self) -> bool:
        """Whether this run places its towers by cost (refused where the example has no costs)."""
        if self.spec.baseline or self.spec.tower_order == "arrival":
            return False
        if self.model.tower_costs is None:
            raise ValueError(
                f"run {self.spec.name}: tower_order='balanced' needs the example's per-micro-batch "
                f"tower costs, and {self.job.example!r} has none (use tower_order='arrival')"
            )
        return True

    def _mean_loss(self, losses: list[Any]) -> float:
        """The mean loss of this step over every micro-batch of every replica (with the
        example's ``token_loss``: each micro-batch's per-token loss weighted by its labelled
        tokens, so the replica's per-token mean, however its samples fall into micro-batches)."""
        values = [float(x.asnumpy()) for x in losses]
        mean = token_mean(values, self._label_counts) if self._token_loss else statistics.fmean(values)
        if self._loss_group is None:
            return mean
        # Per-token loss: the replicas' means weighted by their labelled tokens (packed shards
        # hold different counts), as the gradients are (``loss_reduction="token"``).
        weight = float(sum(self._label_counts)) if self._token_loss else 1.0
        total = ms.Tensor(np.array([mean * weight, weight], dtype=np.float32))
        self._loss_group.all_reduce_sum([total])
        summed, weights = total.asnumpy().tolist()
        return summed / weights if weights > 0 else 0.0

    def _update(self) -> None:
        # The schedule's own end of step: a non-finite gradient anywhere is refused on every rank
        # (skipped, with a NonFiniteGradientWarning) instead of turning every weight into NaN.
        self.schedule.step(self.optimizer)

    def finish(self, run_dir: Path) -> RankRecord:
        """Write this rank's record of the run (with transfer sizes and dispatch if asked)."""
        activation = preprocess = 0
        dispatch = None
        if self.job.calibrate:
            inputs = self._stage_inputs()
            preprocess = 0 if self.spec.baseline else nbytes(inputs[0])  # the baseline ships none
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
            memory=self.schedule.stats()["memory"] if self.records else None,
        )
        record.write(run_dir)
        if self.job.nodes > 1:  # the launcher of every host reports on every rank
            for other in all_gather_objects(record, self.job.timeout_s, "gathering the rank records"):
                if other.rank != self.rank:
                    _write_atomically(other, run_dir)
        return record

    # -- calibration ---------------------------------------------------------------------------

    def _stage_inputs(self) -> list[tuple[Any, ...]]:
        """Micro-batch 0's input of every stage but the last, computed eagerly on this rank."""
        inputs, _ = self._replica_batch(0)
        rows = self.rows // self.job.micro
        x = tuple(t[:rows] for t in inputs)
        if self.model.preprocess is not None:
            x = _as_tuple(self.model.preprocess(*x))
        out = [x]
        for chunk in self.chunks[:-1]:
            out.append(_as_tuple(chunk(*out[-1])))
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
            preprocess=self.model.preprocess,
            loss_fn=self.model.loss_fn,
            last_stage=self.num_stages - 1,
        )
        bare = executor.bare_stage_forward(stage)
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


def _write_atomically(record: RankRecord, run_dir: Path) -> None:
    """Write another rank's record (every worker of a host writes it: last rename wins)."""
    path = record.path(run_dir)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
    os.replace(tmp, path)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    """A cell's output as a tuple (a single tensor becomes a 1-tuple)."""
    return value if isinstance(value, tuple) else (value,)


def checkpoint_due(job: JobSpec, steps_done: int) -> bool:
    """Whether a checkpoint is written after ``steps_done`` steps: every ``save_every`` steps
    and after the last one, when the job has a checkpoint directory."""
    if job.checkpoint_dir is None:
        return False
    return steps_done == job.end_step or (job.save_every > 0 and steps_done % job.save_every == 0)


def train(job: JobSpec, run_dir: Path) -> None:
    """Every run of ``job``, interleaved step by step so machine noise hits all runs alike.

    The runs' order rotates from step to step (each run goes first equally often), so that what
    following another run costs (its data in the caches, the collector's work) is shared too.
    """
    if job.checkpoint_dir is not None and len(job.runs) != 1:
        raise ValueError(f"checkpoints need a job with one run, this one has {len(job.runs)}")
    bound_backend_waits(job.timeout_s)  # before the mesh check, the process's first message
    mesh = DeviceMesh(dp=job.dp, pp=job.pp)
    trainers = [Trainer(job, spec, mesh) for spec in job.runs]

    def compiled() -> tuple[int, float]:
        graphs, seconds = 0, 0.0
        for trainer in trainers:
            try:
                stats = trainer.schedule.stats()
            except GraphExecError:  # its first run() has not set it up yet
                continue
            graphs, seconds = graphs + stats["compilations"], seconds + stats["compile_seconds"]
        return graphs, seconds

    if job.first_step:
        for trainer in trainers:
            trainer.resume(job.first_step)
    for index in range(job.first_step, job.end_step):
        # the first step compiles
        with CompileWatch(compiled) if index == job.first_step else nullcontext():
            turn = index % len(trainers)
            for trainer in trainers[turn:] + trainers[:turn]:
                record = trainer.step(index)
                saved = trainer.save(index + 1) if checkpoint_due(job, index + 1) else None
                trainer.report(record, saved)
    if job.export_dir is not None:
        from graph_exec.models import export_pretrained

        announce("exporting")
        for trainer in trainers:  # a whole-model split holds everything: each rank writes its share
            export_pretrained(
                dataclasses.replace(trainer.model.split, rank=mesh.pp_rank, pp=mesh.pp_size),
                job.export_dir,
                overwrite=job.export_overwrite,
                replica=mesh.dp_rank,
                dtype=job.export_dtype,
                timeout_s=job.timeout_s,
            )
    announce("finishing")
    for trainer in trainers:
        trainer.finish(run_dir)


def _token_loss_options() -> dict[str, Any]:
    """The schedule options of an example's ``token_loss``: the per-token mean of the global batch."""
    from graph_exec.models import causal_lm_token_loss

    return {"loss_fn": causal_lm_token_loss, "loss_reduction": "token"}


def token_mean(losses: Sequence[float], counts: Sequence[int]) -> float:
    """The per-token mean of micro-batches whose per-token means are ``losses`` over ``counts``
    labelled tokens each."""
    return sum(v * c for v, c in zip(losses, counts, strict=True)) / max(sum(counts), 1)


def _labelled(labels: Any) -> int:
    """The labelled (non-negative) positions of a micro-batch's labels."""
    array = labels.asnumpy() if hasattr(labels, "asnumpy") else np.asarray(labels)
    return int((array >= 0).sum())
