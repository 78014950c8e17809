"""Checkpoint and resume on 2 ranks: exact resume in every set-up, and the fault cases.

``checkpoint_checks.py train DIR`` (first launch), per case: run A trains 6 steps with Adam
and keeps its losses and final parameters (also written to ``DIR/ref``); run B trains 3
steps and saves (steps 2 and 3); run C, in the same process but built from another seed,
loads step 3 and trains 3 more, compared with A's steps 4-6 (atol 1e-6). Then a rank is
killed while saving: ``KILL_RANK`` in the environment names the rank whose MindSpore
``save_checkpoint`` kills its own process right after writing the temporary file (the hook
lives here, not in the library). That ends the launch.

``checkpoint_checks.py resume DIR`` (second launch, a new job): run C again for every case
from the files of the first launch; the killed save's directory loads step 3; then a
corrupted and a missing rank file, checkpoints of another model, optimizer class or without
the optimizer state of the preprocess (refused), one of another plan (``DIR/world1``, written by
the test in one process: loaded by name) and a save that fails on one rank.

Prints ``CHECK <name> OK`` (or ``FAIL <detail>``) per check; failures are counted, not
raised, so the ranks stay in step; ``ALL DONE failures=N`` at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_rank, init

import graph_exec as ge
from graph_exec.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport import barrier
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build

RANKS, MICRO, BATCH, LR, ATOL = 2, 4, 8, 1e-2, 1e-6
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Case:
    name: str
    preprocess: str = "trainable"
    backward: str = "central"
    mode: str = "graph"
    vpp: int = 2
    baseline: bool = False


CASES = [
    Case("trainable_central_graph"),
    Case("trainable_owner_graph", backward="owner"),
    Case("frozen_graph", preprocess="frozen"),
    Case("trainable_central_pynative", mode="pynative"),
    Case("trainable_owner_pynative", backward="owner", mode="pynative"),
    Case("frozen_pynative", preprocess="frozen", mode="pynative"),
    Case("baseline_graph", preprocess="none", baseline=True),
]
failures = 0


def check(name: str, ok: bool, detail: object = "") -> None:
    global failures
    failures += not ok
    print(f"CHECK {name} {'OK' if ok else f'FAIL {detail}'}", flush=True)


class Job:
    """This rank's share of one training job: chunks, schedule, Adam."""

    def __init__(self, case: Case, seed: int = 0, vpp: int | None = None, preprocess: str | None = None):
        rank = get_rank()
        stages = RANKS * (vpp or case.vpp)
        self.model = build(stages, preprocess or case.preprocess, seed=seed)
        local = [ge.PipelineStage(self.model.stages[s], s, stages) for s in range(rank, stages, RANKS)]
        common = {"mode": case.mode, "loss_fn": loss_fn, "timeout_s": TIMEOUT_S}
        if case.baseline:
            self.sched = ge.ScheduleInterleaved1F1B(local, MICRO, **common)
        else:
            self.sched = ge.ScheduleMPipeTranspose(
                local,
                MICRO,
                self.model.preprocess,
                1 if self.model.preprocess else 0,
                backward=case.backward,
                **common,
            )
        self.cells = [s.submodule for s in local] + ([self.model.preprocess] if self.model.preprocess else [])
        self.opt = nn.Adam(self.sched.trainable_params(), learning_rate=LR)

    def train(self, first: int, count: int) -> list[list[float]]:
        losses = []
        for step in range(first, first + count):
            x, labels = batch(BATCH, seed=100 + step)
            out = self.sched.run(x, labels=labels)
            if out is not None:
                losses.append([float(v.asnumpy()) for v in out])
            self.opt(tuple(self.sched.grads().values()))
            self.sched.zero_grad()
        return losses

    def values(self) -> dict[str, np.ndarray]:
        return {p.name: p.asnumpy().copy() for c in self.cells for p in c.get_parameters()}

    def save(self, directory: Path, step: int) -> None:
        ge.save_checkpoint(self.sched, directory, step, optimizer=self.opt)

    def load(self, directory: Path, **kw) -> int:
        return ge.load_checkpoint(self.sched, directory, optimizer=self.opt, **kw)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = ATOL) -> str:
    """'' if equal within ``atol``, else the first difference."""
    if set(a) != set(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        if not np.allclose(a[name], b[name], atol=atol, rtol=0):
            return f"{name}: max diff {np.abs(a[name] - b[name]).max():.3g}"
    return ""


def compare_resumed(label: str, c: Job, losses: list, ref_losses: np.ndarray, ref_values: dict) -> None:
    check(f"{label}.params", not same(c.values(), ref_values), same(c.values(), ref_values))
    if losses:
        got = np.array(losses)
        ok = got.shape == ref_losses.shape and np.allclose(got, ref_losses, atol=ATOL, rtol=0)
        check(f"{label}.losses", ok, f"{got} vs {ref_losses}")


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception:
        traceback.print_exc()
        check(name, False, "raised")


def train_phase(root: Path) -> None:
    rank = get_rank()
    (root / "ref").mkdir(parents=True, exist_ok=True)
    for case in CASES:

        def run(case=case) -> None:
            a = Job(case)
            losses_a = a.train(0, 6)
            ref_values = a.values()
            ref_losses = np.array(losses_a[3:]) if losses_a else np.zeros((0,))
            np.savez(root / "ref" / f"{case.name}.rank{rank}.npz", losses=ref_losses, **ref_values)
            b = Job(case)
            b.train(0, 2)
            b.save(root / case.name, 2)
            b.train(2, 1)
            b.save(root / case.name, 3)
            c = Job(case, seed=7)
            step = c.load(root / case.name)
            check(f"{case.name}.same_job.step", step == 3, step)
            compare_resumed(f"{case.name}.same_job", c, c.train(3, 3), ref_losses, ref_values)

        guarded(case.name, run)

    # A rank dies while saving step 6: the checkpoint of step 3 must stay the latest.
    kill = os.environ.get("KILL_RANK")
    job = Job(CASES[0])
    job.train(0, 3)
    job.save(root / "killed", 3)
    job.train(3, 3)
    if kill is not None and int(kill) == rank:
        original = ms.save_checkpoint

        def save_then_die(*args, **kwargs):
            original(*args, **kwargs)
            print(f"KILLING rank {rank} while saving", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        ms.save_checkpoint = save_then_die
    print("CHECK train_phase_done OK", flush=True)
    try:
        job.save(root / "killed", 6)
        check("killed.save_raises", False, "save returned")
    except Exception as exc:  # the survivors' deadline (if msrun has not stopped them first)
        print(f"save of step 6 failed as it should: {type(exc).__name__}: {exc}", flush=True)


def resume_phase(root: Path) -> None:
    rank = get_rank()
    for case in CASES:

        def run(case=case) -> None:
            ref = np.load(root / "ref" / f"{case.name}.rank{rank}.npz")
            ref_values = {k: ref[k] for k in ref.files if k != "losses"}
            c = Job(case, seed=7)
            step = c.load(root / case.name)
            check(f"{case.name}.new_job.step", step == 3, step)
            compare_resumed(f"{case.name}.new_job", c, c.train(3, 3), ref["losses"], ref_values)

        guarded(case.name, run)

    base = CASES[0]
    guarded("killed", lambda: check("killed.loads_step_3", Job(base, seed=7).load(root / "killed") == 3))

    def expect(name: str, error: type, fn, *phrases: str) -> None:
        """``fn`` must raise ``error`` whose text holds every phrase, leaving ``job`` untouched."""
        job = Job(base, seed=11)
        before = job.values()
        try:
            fn(job)
            check(name, False, "no error")
        except error as exc:
            text = str(exc)
            print(f"{name}: {type(exc).__name__}: {text}", flush=True)
            missing = [p for p in phrases if p not in text]
            check(name, not missing and not same(job.values(), before, atol=0), f"missing {missing}")

    def prepared(name: str, damage) -> Path:
        """A copy of the first case's checkpoints, damaged by rank 0 while rank 1 waits."""
        target = root / name
        if rank == 0:
            shutil.copytree(root / base.name, target)
            damage(target)
        barrier()
        return target

    def corrupt(target: Path) -> None:
        path = target / "step_3" / "rank_1.ckpt"
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0xFF
        path.chmod(0o600)
        path.write_bytes(bytes(data))

    corrupted = prepared("corrupted", corrupt)
    expect(
        "corrupted.explicit_step_is_reported_on_every_rank",
        CheckpointCorruptError,
        lambda job: job.load(corrupted, step=3),
        "step_3/rank_1.ckpt",
        "rank 1's file of step 3",
    )

    def falls_back() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step = Job(base, seed=7).load(corrupted)
        said = " | ".join(str(w.message) for w in seen)
        check("corrupted.falls_back_to_step_2", step == 2, step)
        check("corrupted.says_so", "step 3" in said and "rank 1" in said and "step 2 instead" in said, said)
        barrier()
        check(
            "corrupted.set_aside",
            (corrupted / "step_3.corrupt").is_dir() and not (corrupted / "step_3").exists(),
        )

    guarded("corrupted", falls_back)
    missing = prepared("missing", lambda target: (target / "step_3" / "rank_1.ckpt").unlink())
    guarded("missing", lambda: check("missing.falls_back_to_step_2", Job(base, seed=7).load(missing) == 2))
    expect(
        "missing.explicit_step_is_incomplete",
        CheckpointNotFoundError,
        lambda job: job.load(missing, step=3),
        "rank_1.ckpt, which do not exist",
    )

    # Checkpoints of another model or optimizer: refused on every rank, naming it, nothing loaded.
    expect(
        "other_model",
        CheckpointMismatchError,
        lambda job: ge.load_checkpoint(Job(base, vpp=1).sched, root / base.name),
        "does not fit rank 1's model",
    )
    expect(
        "missing_optimizer_state",
        CheckpointMismatchError,
        lambda job: job.load(root / "frozen_graph"),
        "optimizer state missing from the checkpoint: moment1.pre.",
    )
    expect(
        "other_optimizer",
        CheckpointMismatchError,
        lambda job: ge.load_checkpoint(
            job.sched, root / base.name, optimizer=nn.Momentum(job.sched.trainable_params(), 0.1, 0.9)
        ),
        "holds the state of optimizer class Adam, this job's is Momentum",
    )

    # A checkpoint of another plan (one process, all 4 stages): each rank loads its names from it.
    def other_world_size() -> None:
        job = Job(base, seed=11)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step = job.load(root / "world1")
        saved = {
            k: v.asnumpy()
            for k, v in ms.load_checkpoint(str(root / "world1" / "step_3" / "rank_0.ckpt")).items()
        }
        mine = job.values()
        moments = {p.name: p.asnumpy() for p in job.opt.get_parameters() if p.name.startswith("moment1.")}
        check("other_world_size.loads_by_name", step == 3 and not same(mine, {k: saved[k] for k in mine}, 0))
        check(
            "other_world_size.optimizer_state",
            bool(moments) and not same(moments, {k: saved[k] for k in moments}, 0),
        )
        said = " | ".join(str(w.message) for w in seen)
        check(
            "other_world_size.says_what_changed",
            rank != 0 or "world size: checkpoint 1, this job 2" in said,
            said,
        )

    guarded("other_world_size", other_world_size)
    expect(
        "save_twice",
        CheckpointExistsError,
        lambda job: job.save(root / base.name, 3),
        "step 3 already exists",
    )

    # A save that fails on rank 1 only (a full disk): every rank raises, step 3 stays the latest.
    def failing_save(job: Job) -> None:
        original = ms.save_checkpoint

        def no_space(*args, **kwargs):
            raise OSError(28, "No space left on device")

        if rank == 1:
            ms.save_checkpoint = no_space
        try:
            job.save(root / "failing", 4)
        finally:
            ms.save_checkpoint = original

    if rank == 0:
        shutil.copytree(root / base.name, root / "failing")
    barrier()
    expect("failed_save.reported_on_every_rank", CheckpointError, failing_save, "rank 1", "No space left")
    check("failed_save.previous_stays_latest", ge.latest_checkpoint(root / "failing") == 3)

    # Hosts with disks of their own (here: a directory per rank): refused, on every rank.
    expect(
        "own_disks.refused_on_every_rank",
        CheckpointError,
        lambda job: job.save(root / f"disk_{rank}", 1),
        "rank 0 cannot see the files of rank(s) [1]",
        "shared by every host",
    )
    check("own_disks.never_complete", ge.latest_checkpoint(root / f"disk_{rank}") is None)

    # Each rank's random generator state comes back with its checkpoint.
    def generator_state() -> None:
        job = Job(base)
        ms.manual_seed(100 + rank)
        job.save(root / "rng", 1)
        ms.manual_seed(5)
        job.load(root / "rng")
        check("rng.restored_per_rank", ms.default_generator.initial_seed() == 100 + rank)

    guarded("rng", generator_state)


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    prepare_mindspore("CPU")
    announce_policy()
    init()
    {"train": train_phase, "resume": resume_phase}[phase](root)
    print(f"ALL DONE failures={failures}", flush=True)


if __name__ == "__main__":
    main()
