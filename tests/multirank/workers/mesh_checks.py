"""Data parallel x pipeline parallel on 4 ranks, in one msrun job, against the reference.

Usage: ``mesh_checks.py SUITE`` with SUITE one of :data:`SUITES` (``all`` runs both layouts
and the bad-input checks in one launch; communication init costs seconds).

Each replica ``k`` of ``D`` trains on its own share ``k`` of a global batch of ``D·M``
micro-batches. The reference runs that whole global batch, non-pipelined, in this process:
with ``scale_grads`` the averaged gradients must equal the gradient of the mean loss over all
``D·M`` micro-batches, without it ``1/D`` of the summed gradient (atol 1e-5, rtol 1e-4, from
tests.models.common). Replica ``k``'s last pipeline rank must return the reference losses of
micro-batches ``k·M … k·M+M−1``. Comparisons print ``CHECK <name> OK|FAIL`` and never raise,
so the ranks stay in step.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, amp, nn
from mindspore.communication import get_rank

import graph_exec as ge
from graph_exec.checkpoint import ReshardWarning
from graph_exec.errors import CommunicationNotInitializedError, ConfigurationMismatchError, RemoteRankError
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport import all_gather_objects
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference, sgd_step
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy

TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    name: str
    dp: int
    pp: int
    vpp: int = 2
    micro: int = 4  #: per replica
    preprocess: str = "trainable"  # trainable | frozen | none
    backward: str = "central"
    baseline: bool = False  # ScheduleInterleaved1F1B (no preprocess to transpose)
    scale_grads: bool = True
    optimizer: bool = False  # an SGD step, then a second step against the reference doing the same
    twice: bool = False  # a second run() without zero_grad holds twice the averaged gradient
    replica_seed: bool = False  # replicas built from different seeds must start from replica 0's weights
    body: str = "interleaved"  # the schedules' body ("zb": the split backward)


LAYOUTS: dict[str, list[Case]] = {
    "dp2pp2": [
        Case("dp2pp2_trainable_central", 2, 2, optimizer=True, twice=True),
        Case("dp2pp2_trainable_owner", 2, 2, backward="owner", optimizer=True),
        Case("dp2pp2_frozen", 2, 2, preprocess="frozen", scale_grads=False),
        Case("dp2pp2_baseline", 2, 2, preprocess="none", baseline=True, optimizer=True),
        Case("dp2pp2_replicas_start_equal", 2, 2, replica_seed=True),
    ],
    "dp4pp1": [
        Case("dp4pp1_trainable", 4, 1, micro=2, optimizer=True, twice=True),
        Case("dp4pp1_none_unscaled", 4, 1, micro=2, preprocess="none", scale_grads=False),
    ],
}
SUITES = {**LAYOUTS, "all": [c for cases in LAYOUTS.values() for c in cases]}
#: The split backward on the dp2 x pp2 mesh (tests/multirank/test_zero_bubble.py).
SUITES["zb_dp2pp2"] = [
    Case("zb_dp2pp2_trainable_owner", 2, 2, backward="owner", body="zb", optimizer=True, twice=True),
    Case("zb_dp2pp2_baseline", 2, 2, preprocess="none", baseline=True, body="zb"),
]


#: ZeRO-1 (``zero`` suite): Adam steps compared, the clipping threshold (below the first norms,
#: so every step clips) and where both runs are checkpointed and resumed.
ZERO_STEPS, ZERO_MAX_NORM, ZERO_SAVE_AFTER = 3, 0.05, 1


class ZeroRun:
    """One dp 2 x pp 2 training job with Adam, clipping and a dynamic loss scaler, sharded or not."""

    def __init__(self, mesh: ge.DeviceMesh, mode: str, sharded: bool) -> None:
        self.mesh = mesh
        self.model = build(4, "trainable")
        stages = [ge.PipelineStage(self.model.stages[s], s, 4) for s in range(self.mesh.pp_rank, 4, 2)]
        self.kind = "sharded" if sharded else "unsharded"
        self.sched = ge.ScheduleMPipeTranspose(
            stages,
            4,
            self.model.preprocess,
            1,
            loss_fn=loss_fn,
            mesh=self.mesh,
            mode=mode,
            timeout_s=TIMEOUT_S,
            loss_scaler=amp.DynamicLossScaler(2.0**10, 2, 1000),
            optimizer_sharding=sharded,
        )
        self.opt = nn.Adam(self.sched.optimizer_params(), learning_rate=0.01)
        self.x, self.labels = batch(16)
        self.mine = slice(self.mesh.dp_rank * 8, (self.mesh.dp_rank + 1) * 8)
        self.losses: list[list[float]] = []
        self.norms: list[float] = []
        self.start = self.values()

    def train(self, steps: int) -> None:
        for _ in range(steps):
            losses = self.sched.run(self.x[self.mine], labels=self.labels[self.mine])
            self.losses.append([] if losses is None else [float(v.asnumpy()) for v in losses])
            self.norms.append(self.sched.step(self.opt, max_norm=ZERO_MAX_NORM)["grad_norm"])

    def values(self) -> dict[str, np.ndarray]:
        """Every parameter of this rank's cells (the preprocess replica included)."""
        cells = [self.model.preprocess, *(self.model.stages[s] for s in range(self.mesh.pp_rank, 4, 2))]
        return {p.name: p.asnumpy().copy() for cell in cells for p in cell.get_parameters()}


def zero_case(mesh: ge.DeviceMesh, mode: str, checker: Checker, root: Path | None) -> None:
    """Sharded against unsharded: the same losses and parameters after each Adam step (bit for
    bit: the owner computes what every replica would), half the optimizer state (within one
    parameter's), and with ``root`` both runs checkpointed there after step ``ZERO_SAVE_AFTER``:
    a resume from the sharded checkpoint gives the same last steps, sharded (same plan) and
    unsharded, and one from the unsharded checkpoint sharded (:func:`cross_resume`)."""
    name = f"zero_{mode}"
    whole, sharded = ZeroRun(mesh, mode, False), ZeroRun(mesh, mode, True)
    saved_rng: dict[str, np.ndarray] = {}
    for run in (whole, sharded):
        run.train(ZERO_SAVE_AFTER)
        if root is not None:
            saved_rng[run.kind] = ms.get_rng_state().asnumpy()  # what the save stores
            ge.save_checkpoint(run.sched, root / f"{name}_{run.kind}", ZERO_SAVE_AFTER, optimizer=run.opt)
        run.train(ZERO_STEPS - ZERO_SAVE_AFTER)
    checker.check(
        f"{name}.losses_equal", sharded.losses == whole.losses, f"{sharded.losses} vs {whole.losses}"
    )
    checker.check(f"{name}.clipped", all(n > ZERO_MAX_NORM for n in whole.norms), f"norms {whole.norms}")
    checker.check(f"{name}.norms_equal", sharded.norms == whole.norms, f"{sharded.norms} vs {whole.norms}")
    expected, got = whole.values(), sharded.values()
    differ = [k for k in expected if not np.array_equal(expected[k], got[k])]
    checker.check(f"{name}.params_equal", not differ and set(got) == set(expected), f"differ: {differ}")
    trained = {p.name for p in whole.sched.trainable_params()}
    still = [k for k in trained if np.array_equal(expected[k], whole.start[k])]
    checker.check(f"{name}.params_trained", not still, f"unchanged: {still}")
    memory = {run: run.sched.stats()["memory"] for run in (whole, sharded)}
    state = {run: memory[run]["optimizer_state"] for run in memory}
    largest = max(int(p.nbytes) for p in whole.sched.trainable_params())
    per_param = 2 * largest  # Adam's two moments of the largest parameter
    checker.check(
        f"{name}.state_halved",
        abs(state[sharded] - state[whole] / 2) <= per_param,
        f"sharded {state[sharded]} B vs unsharded {state[whole]} B (one parameter's state {per_param} B)",
    )
    owned = sharded.sched.stats()["optimizer_sharding"]
    checker.check(
        f"{name}.stats",
        owned.owned_parameter_bytes == memory[sharded]["optimizer_parameters"]
        and owned.parameters == len(whole.sched.trainable_params())
        and owned.gathers == ZERO_STEPS,
        f"{owned} vs {memory[sharded]['optimizer_parameters']}",
    )
    if root is None:
        refusals(sharded, checker, name)
        return
    resumed = ZeroRun(mesh, mode, True)
    loaded = ge.load_checkpoint(resumed.sched, root / f"{name}_sharded", optimizer=resumed.opt)
    resumed.train(ZERO_STEPS - ZERO_SAVE_AFTER)
    same = resumed.values()
    differ = [k for k in got if not np.array_equal(got[k], same[k])]
    checker.check(
        f"{name}.resume_exact",
        loaded == ZERO_SAVE_AFTER and not differ and resumed.losses == sharded.losses[ZERO_SAVE_AFTER:],
        f"step {loaded}, differ: {differ}",
    )
    start = time.perf_counter()
    reference = Finished(list(whole.losses), list(whole.norms), expected)
    for run, written in ((whole, "sharded"), (sharded, "unsharded")):
        folder = root / f"{name}_{written}"
        label = f"{name}.resume_{written}_into_{run.kind}"
        cross_resume(run, folder, saved_rng[written], reference, checker, label)
    print(f"{name} cross-resume seconds: {time.perf_counter() - start:.1f}", flush=True)


@dataclass(frozen=True)
class Finished:
    """What the uninterrupted unsharded run ended with."""

    losses: list[list[float]]
    norms: list[float]
    values: dict[str, np.ndarray]


def cross_resume(
    run: ZeroRun, folder: Path, saved_rng: np.ndarray, reference: Finished, checker: Checker, name: str
) -> None:
    """Load into ``run`` the step-``ZERO_SAVE_AFTER`` checkpoint written with the other
    ``optimizer_sharding``, train to ``ZERO_STEPS``: losses, norms and every parameter equal the
    uninterrupted run's bit for bit (same plan; only which replica keeps which moments changed).

    ``run`` has already trained to the end, so anything the load left out would be stale (its
    moments three steps old) and show; its compiled graphs are reused (the load is in place).
    The generator is moved off before the load: it must come back (only the partition changed).
    Rank 0 must warn that the checkpoint was written with the other ``optimizer_sharding``."""
    ms.manual_seed(12345)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = ge.load_checkpoint(run.sched, folder, optimizer=run.opt)
    said = any(
        issubclass(w.category, ReshardWarning) and "option optimizer_sharding" in str(w.message) for w in seen
    )
    rng_back = np.array_equal(ms.get_rng_state().asnumpy(), saved_rng)
    steps = ZERO_STEPS - ZERO_SAVE_AFTER
    run.train(steps)
    got = run.values()
    differ = [k for k in reference.values if not np.array_equal(reference.values[k], got[k])]
    checker.check(
        name,
        loaded == ZERO_SAVE_AFTER
        and said == (get_rank() == 0)
        and rng_back
        and run.losses[-steps:] == reference.losses[-steps:]
        and run.norms[-steps:] == reference.norms[-steps:]
        and not differ
        and set(got) == set(reference.values),
        f"step {loaded}, warned {said}, generator back {rng_back}, losses {run.losses} vs "
        f"{reference.losses}, norms {run.norms} vs {reference.norms}, differ: {differ}",
    )


class GlobalNormAdam(nn.Adam):
    """An Adam that also keeps one tensor over all its parameters: not shardable by parameter."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.norm_history = Parameter(Tensor(np.zeros(4, np.float32)), name="norm_history")


def refusals(run: ZeroRun, checker: Checker, name: str) -> None:
    """``step()`` refuses, on every rank and before any update, an optimizer over parameters
    another replica owns and one whose state is not per parameter; the schedule stays usable."""
    before = run.values()
    for label, optimizer, pattern in (
        ("not_owned", nn.Adam(run.sched.trainable_params()), "which another replica owns"),
        ("global_state", GlobalNormAdam(run.sched.optimizer_params()), "its state 'norm_history'"),
    ):
        run.sched.run(run.x[run.mine], labels=run.labels[run.mine])
        expect_error(
            checker,
            f"{name}.refuses_{label}",
            (ValueError, RemoteRankError),
            lambda o=optimizer: run.sched.step(o),
            pattern,
        )
        run.sched.zero_grad()
    after = run.values()
    # what this rank trains (its preprocess replica, trained on pipeline rank 0, is refreshed by run())
    trained = [p.name for p in run.sched.trainable_params()]
    checker.check(
        f"{name}.refusals_update_nothing", all(np.array_equal(before[k], after[k]) for k in trained)
    )


def zero_suite(checker: Checker, rank: int) -> int:
    """Both modes (the checkpoint in graph mode: what it stores does not depend on the mode),
    then the checkpoint removed (after every rank is done with it)."""
    root = Path(all_gather_objects(tempfile.mkdtemp(prefix="zero_checks_"), TIMEOUT_S, "directory")[0])
    mesh = ge.DeviceMesh(dp=2, pp=2)
    try:
        for mode in ("graph", "pynative"):
            start = time.perf_counter()
            zero_case(mesh, mode, checker, root if mode == "graph" else None)
            print(f"zero_{mode} seconds: {time.perf_counter() - start:.1f}", flush=True)
    except Exception:
        traceback.print_exc()
        checker.check("zero.ran", False, "raised (traceback above)")
        return 1  # the message order is lost: the other ranks will report it too
    all_gather_objects(None, TIMEOUT_S, "the end of the zero suite")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    print(f"ALL DONE failures={checker.failures}", flush=True)
    return int(checker.failures > 0)


def run_case(case: Case, checker: Checker, results: dict[str, float]) -> None:
    mesh = ge.DeviceMesh(dp=case.dp, pp=case.pp)
    num_stages = case.pp * case.vpp
    seed = 7 * mesh.dp_rank if case.replica_seed else 0
    model = build(num_stages, case.preprocess, seed=seed)
    ref = build(num_stages, case.preprocess)
    local = range(mesh.pp_rank, num_stages, case.pp)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in local]
    common = {
        "loss_fn": loss_fn,
        "scale_grads": case.scale_grads,
        "timeout_s": TIMEOUT_S,
        "mesh": mesh,
        "body": case.body,
    }
    if case.baseline:
        sched = ge.ScheduleInterleaved1F1B(stages, case.micro, **common)
    else:
        pre = model.preprocess
        sched = ge.ScheduleMPipeTranspose(
            stages, case.micro, pre, 0 if pre is None else 1, backward=case.backward, **common
        )
    rows = 2  # per micro-batch
    per_replica = rows * case.micro
    x, labels = batch(case.dp * per_replica)
    mine = slice(mesh.dp_rank * per_replica, (mesh.dp_rank + 1) * per_replica)
    total_micro = case.dp * case.micro
    scale = 1.0 / total_micro if case.scale_grads else 1.0 / case.dp
    ref_losses, ref_grads = reference(ref, x, labels, total_micro, scale)
    expected_names = {p.name for p in sched.trainable_params()}
    expected = {k: v for k, v in ref_grads.items() if k in expected_names}
    my_losses = ref_losses[mesh.dp_rank * case.micro : (mesh.dp_rank + 1) * case.micro]
    holds_last = mesh.pp_rank == case.pp - 1

    start = time.perf_counter()
    losses = sched.run(x[mine], labels=labels[mine])
    results[case.name] = time.perf_counter() - start
    checker.check(f"{case.name}.losses_where_expected", (losses is not None) == holds_last)
    if holds_last:
        checker.losses(f"{case.name}.losses", losses, my_losses)
    checker.close(f"{case.name}.grads", grads_numpy(sched), expected)
    if case.twice:
        sched.run(x[mine], labels=labels[mine])
        checker.close(f"{case.name}.accumulates_twice", grads_numpy(sched), expected, factor=2.0)
        sched.zero_grad()
        sched.run(x[mine], labels=labels[mine])
        checker.close(f"{case.name}.zero_grad_then_run", grads_numpy(sched), expected)
    if case.optimizer:
        lr = 0.5
        params = sched.trainable_params()
        nn.SGD(params, learning_rate=lr)(tuple(sched.grads()[p.name] for p in params))
        sgd_step(ref.params(), ref_grads, lr)
        sched.zero_grad()
        losses = sched.run(x[mine], labels=labels[mine])
        ref_losses, ref_grads = reference(ref, x, labels, total_micro, scale)
        if holds_last:
            my_losses = ref_losses[mesh.dp_rank * case.micro : (mesh.dp_rank + 1) * case.micro]
            checker.losses(f"{case.name}.after_step_losses", losses, my_losses)
        checker.close(
            f"{case.name}.after_step_grads", grads_numpy(sched), {k: ref_grads[k] for k in expected}
        )
    stats = sched.stats()["data_parallel"] if case.dp > 1 else None
    checker.check(
        f"{case.name}.bucketed",
        stats is not None and 1 <= stats.buckets < len(expected),
        f"{stats} for {len(expected)} tensors",
    )


def expect_error(checker: Checker, name: str, errors: tuple[type, ...], make, pattern: str) -> None:
    """``make()`` must raise one of ``errors`` whose text contains ``pattern``, quickly."""
    start = time.monotonic()
    try:
        make()
    except errors as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
        waited = time.monotonic() - start
        checker.check(name, pattern in str(exc) and waited < TIMEOUT_S / 2, f"{exc} after {waited:.1f} s")
        return
    checker.check(name, False, "no error")


def bad_inputs(checker: Checker, rank: int) -> None:
    """Every rank gets every bad-input error, before any training message."""
    expect_error(
        checker, "bad.dp_times_pp_not_world", (ValueError,), lambda: ge.DeviceMesh(dp=3, pp=2), "4 ranks"
    )
    expect_error(
        checker,
        "bad.ranks_disagree_on_mesh",
        (ConfigurationMismatchError,),
        lambda: ge.DeviceMesh(dp=4 if rank == 3 else 2),
        "different device meshes",
    )
    # Replicas (same pipeline rank, other dp rank) that disagree on an option: every rank stops.
    mesh = ge.DeviceMesh(dp=2, pp=2)
    model = build(4, "trainable")
    stages = [ge.PipelineStage(model.stages[s], s, 4) for s in range(mesh.pp_rank, 4, 2)]
    x, labels = batch(8)

    def disagreeing():
        scale = mesh.dp_rank == 1  # replica 1 agrees with itself, not with replica 0
        ge.ScheduleMPipeTranspose(
            stages, 4, model.preprocess, 1, loss_fn=loss_fn, mesh=mesh, scale_grads=scale, timeout_s=TIMEOUT_S
        ).run(x, labels=labels)

    expect_error(checker, "bad.replicas_disagree", (ConfigurationMismatchError,), disagreeing, "ranks [2, 3]")
    # A wrong stage on one rank of replica 1 stops the ranks of replica 0 too.
    wrong = [ge.PipelineStage(model.stages[0], 0, 4)] if rank == 3 else stages

    def wrong_stage():
        ge.ScheduleMPipeTranspose(
            wrong, 4, model.preprocess, 1, loss_fn=loss_fn, mesh=mesh, timeout_s=TIMEOUT_S
        ).run(x, labels=labels)

    told = "pipeline rank 1 of 2" if rank == 3 else "ranks [3] could not set up"
    expect_error(
        checker,
        "bad.setup_failure_stops_all_replicas",
        (ConfigurationMismatchError, ValueError),
        wrong_stage,
        told,
    )


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    checker = Checker(-1)
    # Before init(): a mesh with a layout cannot exist yet.
    try:
        ge.DeviceMesh(dp=2, pp=2)
        before_init = "no error"
    except CommunicationNotInitializedError as exc:
        before_init = str(exc)
    from mindspore.communication import get_rank, init

    init()
    rank = get_rank()
    checker = Checker(rank)
    checker.check("bad.mesh_before_init", "init()" in before_init, before_init)
    results: dict[str, float] = {}
    suite = sys.argv[1]
    if suite == "zero":
        return zero_suite(checker, rank)
    for case in SUITES[suite]:
        try:
            run_case(case, checker, results)
        except Exception:
            traceback.print_exc()
            checker.check(f"{case.name}.ran", False, "raised (traceback above)")
            return 1  # the message order is lost: the other ranks will report it too
    if suite == "all":
        bad_inputs(checker, rank)
    print(f"first-step seconds: {results}", flush=True)
    print(f"ALL DONE failures={checker.failures}", flush=True)
    return int(checker.failures > 0)


if __name__ == "__main__":
    sys.exit(main())
