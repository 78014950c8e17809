"""Failure paths on real ranks: every rank must report what failed, where, and stop in time.

Usage: ``failure_checks.py SCENARIO`` (see :data:`SCENARIOS`). Prints ``CHECK <name> OK`` or
``CHECK <name> FAIL <detail>`` and exits 1 if any check failed. A mid-step failure loses the
ranks' message order, so each one ends its job: one scenario per launch. The set-up scenarios
fail at a collective every rank reaches, so they share a launch with one mid-step failure.

After every mid-step failure each rank also checks that the schedule dropped its caches, kept
forwards and receive buffers, and refuses to run again.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.device import fast_paths_requested, wait_until_run
from graph_exec.errors import (
    ConfigurationMismatchError,
    GraphExecError,
    PeerTimeoutError,
    PipelineStepError,
    RemoteRankError,
)
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport.comm import Transport
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import FEATURES, Projector, batch, build

#: Bound on every wait for a peer; short, so that a time-out path ends the job quickly. On the
#: device path (GRAPH_EXEC_CPU_FAST_PATHS=0) MindSpore's asynchronous dispatch makes the steps
#: before a failure several times slower on CPU, so every bound is half as long again.
TIMEOUT_S = 8.0 if fast_paths_requested() else 12.0
#: A failure another rank reports by notice must arrive well before any time-out could fire.
NOTICE_BOUND_S = TIMEOUT_S / 2
#: A time-out fires no earlier than TIMEOUT_S and at most this much later.
TIMEOUT_SLACK_S = TIMEOUT_S / 2

failures = 0


def check(name: str, ok: bool, detail: object = "") -> None:
    global failures
    failures += not ok
    print(f"CHECK {name} {'OK' if ok else f'FAIL {detail}'}", flush=True)


class Armed(nn.Cell):
    """Wraps a stage; once armed, its next forward runs ``action`` (pynative runs it as Python)."""

    def __init__(self, inner: nn.Cell, action: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self.action = action
        self.armed = False

    def construct(self, *h):
        if self.armed:
            self.armed = False
            self.action()
        return self.inner(*h)


def explode() -> None:
    raise RuntimeError("injected failure")


# -- set-up errors ---------------------------------------------------------------------------


def expect_setup_error(name: str, make: Callable[[], Any], error: type, *needles: str) -> None:
    """``make().run(...)`` must raise exactly ``error`` whose message holds every needle, quickly."""
    x, labels = batch(8, seed=2)
    start = time.monotonic()
    try:
        make().run(x, labels=labels)
        check(name, False, "no error")
        return
    except Exception as exc:
        waited = time.monotonic() - start
        text = f"{type(exc).__name__}: {exc}"
        print(f"{name}: {text}", flush=True)
        missing = [n for n in needles if n not in str(exc)]
        ok = type(exc) is error and not missing and waited < NOTICE_BOUND_S
        check(name, ok, f"expected {error.__name__} with {missing} after {waited:.1f} s, got {text}")


def setup_errors(rank: int) -> None:
    model = build(2, "trainable")
    stage = [ge.PipelineStage(model.stages[rank], rank, 2)]

    def schedule(stages=stage, pre=model.preprocess, layers=1):
        return ge.ScheduleMPipeTranspose(stages, 4, pre, layers, loss_fn=loss_fn, timeout_s=TIMEOUT_S)

    # A replica whose parameter shapes differ: caught before the first broadcast.
    other = Projector()
    if rank == 1:
        other.a = nn.Dense(FEATURES, 5)
    other.update_parameters_name("pre.")
    own = ["this rank (rank 1) differs in: preprocess trainable parameters", "pre.a.weight:(5, 6)"]
    expect_setup_error(
        "replica_shapes_differ",
        lambda: schedule(pre=other),
        ConfigurationMismatchError,
        "ranks [1] were set up differently",
        *(own if rank == 1 else []),
    )
    # A rank without a preprocess module: its plan differs.
    expect_setup_error(
        "rank_without_preprocess",
        lambda: schedule(pre=None, layers=0) if rank == 1 else schedule(),
        ConfigurationMismatchError,
        "ranks [1] were set up differently",
        *(["differs in: plan"] if rank == 1 else []),
    )
    # Frozen replicas are never broadcast: different values must be caught.
    frozen = build(2, "frozen")
    if rank == 1:
        ops.assign(frozen.preprocess.a.weight, frozen.preprocess.a.weight + 1)
    expect_setup_error(
        "frozen_values_differ",
        lambda: schedule(pre=frozen.preprocess),
        ConfigurationMismatchError,
        "ranks [1] were set up differently",
        *(["differs in: preprocess frozen values"] if rank == 1 else []),
    )
    # Rank 1 holds the wrong stage: it raises its own error, rank 0 is told which rank failed.
    wrong = [ge.PipelineStage(model.stages[0], 0, 2)]
    if rank == 1:
        expect_setup_error(
            "stages_do_not_fit_world",
            lambda: schedule(stages=wrong),
            ValueError,
            "rank 1 of 2 with 2 stages must hold stages [1]",
        )
    else:
        expect_setup_error(
            "stages_do_not_fit_world",
            schedule,
            ConfigurationMismatchError,
            "ranks [1] could not set up",
        )


# -- mid-step failures -----------------------------------------------------------------------


def expect_step_failure(
    name: str,
    sched: Any,
    inputs: tuple,
    labels: Any,
    needles: list[str],
    cause: type | tuple[type, ...],
    within: tuple[float, float] = (0.0, NOTICE_BOUND_S),
) -> None:
    """``sched.run`` must raise a :class:`PipelineStepError` caused by ``cause``, naming every needle,
    within ``within`` seconds; then the schedule must be clean and refuse to run again."""
    start = time.monotonic()
    try:
        sched.run(*inputs, labels=labels)
        check(name, False, "no error")
        return
    except PipelineStepError as exc:
        waited = time.monotonic() - start
        check_settled(name, sched)
        print(f"{name}: reported after {waited:.1f} s: {exc}", flush=True)
        missing = [n for n in needles if n not in str(exc)]
        ok = isinstance(exc.__cause__, cause) and not missing and within[0] <= waited < within[1]
        wanted = " or ".join(c.__name__ for c in (cause if isinstance(cause, tuple) else (cause,)))
        check(
            name,
            ok,
            f"wanted {wanted} naming {missing} within {within} s; got "
            f"{type(exc.__cause__).__name__} after {waited:.1f} s: {exc}",
        )
    except Exception as exc:
        check(name, False, f"{type(exc).__name__} instead of PipelineStepError: {exc}")
        return
    runtime = sched._setup.runtime
    pool = sched.stats()["pool"]
    leftovers = runtime.caches.leftovers()
    kept = list(runtime.executor.kept())
    check(
        f"{name}.released",
        not leftovers and not kept and pool.live_blocks == 0,
        f"caches {leftovers}, kept forwards {kept}, live receive buffers {pool.live_blocks}",
    )
    try:
        sched.run(*inputs, labels=labels)
        check(f"{name}.refuses_after_failure", False, "ran")
    except GraphExecError as exc:
        check(f"{name}.refuses_after_failure", "restart the job" in str(exc), exc)


def check_settled(name: str, sched: Any) -> None:
    """Right after a reported failure, the parameters read and every op this rank dispatched
    ends without error: the failed step absorbed its abandoned communication's late error (else
    the first wait for MindSpore's pipeline, such as a parameter's ``requires_grad``, raises it)."""
    try:
        [p.requires_grad for p in sched.trainable_params()]
        wait_until_run()
        check(f"{name}.settled", True)
    except RuntimeError as late:
        check(f"{name}.settled", False, f"a late error after the report: {late}")


def armed_schedule(rank: int, pp: int, victim: int, action: Callable[[], None]) -> tuple[Any, Armed | None]:
    """A pynative no-preprocess pipeline on ``pp`` ranks whose stage on ``victim`` can be armed."""
    cells = build(pp, "none").stages
    armed = None
    if rank == victim:
        armed = cells[rank] = Armed(cells[rank], action)
    sched = ge.ScheduleMPipeTranspose(
        [ge.PipelineStage(cells[rank], rank, pp)], 4, loss_fn=loss_fn, mode="pynative", timeout_s=TIMEOUT_S
    )
    return sched, armed


def trainable_schedule(rank: int, mode: str, backward: str = "central") -> Any:
    """MPipe over 2 ranks with a trainable preprocess: the model the mid-step failures run on."""
    model = build(2, "trainable")
    stage = ge.PipelineStage(model.stages[rank], rank, 2)
    return ge.ScheduleMPipeTranspose(
        [stage], 4, model.preprocess, 1, loss_fn=loss_fn, mode=mode, backward=backward, timeout_s=TIMEOUT_S
    )


def healthy_step(name: str, sched: Any, seed: int) -> tuple:
    x, labels = batch(8, seed=seed)
    sched.run(x, labels=labels)
    check(f"{name}.healthy_step_first", True)
    return batch(8, seed=seed + 1)


def scenario_setup(rank: int, pp: int) -> None:
    """A slow first compile that is no hang, set-up errors, then rank 1 raising in pynative mode
    at F1.0. The slow compile comes first: its schedule sets the process's back-end wait limit to
    its ``compile_timeout_s`` (the first setting counts), and no wait in this launch times out,
    so no call of a timed-out wait is left in flight until that longer limit."""
    check_slow_compile(rank, pp, TIMEOUT_S + 2 * TIMEOUT_SLACK_S)
    setup_errors(rank)
    sched, armed = armed_schedule(rank, pp, 1, explode)
    x, labels = healthy_step("raise_pynative", sched, seed=3)
    if armed is not None:
        armed.armed = True
    if rank == 1:
        needles, cause = ["rank 1, step F1.0: RuntimeError: injected failure"], RuntimeError
    else:
        needles, cause = (
            ["peer rank 1", "rank 1: step F1.0 raised RuntimeError: injected failure"],
            RemoteRankError,
        )
    expect_step_failure("raise_pynative", sched, (x,), labels, needles, cause)


def scenario_graph_rank0(rank: int, pp: int) -> None:
    """Graph mode: rank 0 is given inputs of the wrong width; its compiled preprocess fails at TFWD0."""
    sched = trainable_schedule(rank, mode="graph")
    x, labels = healthy_step("graph_rank0_tfwd", sched, seed=5)
    if rank == 0:
        x = ops.concat([x, x[:, :1]], axis=1)  # FEATURES + 1 columns
    if rank == 0:
        needles, cause = ["rank 0, step TFWD0: ValueError: For 'MatMul'"], ValueError
    else:
        needles, cause = (
            ["peer rank 0", "rank 0: step TFWD0 raised ValueError: For 'MatMul'"],
            RemoteRankError,
        )
    expect_step_failure("graph_rank0_tfwd", sched, (x,), labels, needles, cause)


def _inject(method: str, rank: int, victim: int) -> Callable[[], None]:
    """Make ``Transport.<method>`` raise on ``victim`` once armed; returns the arming function."""
    original = getattr(Transport, method)
    state = {"armed": False}

    def wrapper(self, *args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError(f"injected {method} failure")
        return original(self, *args, **kwargs)

    if rank == victim:
        setattr(Transport, method, wrapper)
    return lambda: state.__setitem__("armed", True)


def collective_failure(rank: int, name: str, method: str, step: str, backward: str) -> None:
    """Rank 1's transport raises inside a collective step, before joining the collective."""
    arm = _inject(method, rank, victim=1)
    sched = trainable_schedule(rank, mode="pynative", backward=backward)
    x, labels = healthy_step(name, sched, seed=7)
    arm()
    if rank == 1:
        needles = [f"rank 1, step {step}: RuntimeError: injected {method} failure"]
        expect_step_failure(name, sched, (x,), labels, needles, RuntimeError)
    elif method == "broadcast":
        # Rank 0 is the broadcast's root: its part returns without rank 1 (seen with MCCL), and
        # its next receive from rank 1 reads the abort notice.
        needles = ["rank 0, step OUTrecv1, peer rank 1", f"rank 1: step {step} raised RuntimeError"]
        expect_step_failure(name, sched, (x,), labels, needles, RemoteRankError)
    else:
        # Inside an all-reduce nobody reads notices: rank 0 waits out its time-out, no longer.
        needles = [f"rank 0, step {step}: PeerTimeoutError", "in all-reduce"]
        within = (TIMEOUT_S, TIMEOUT_S + TIMEOUT_SLACK_S)
        expect_step_failure(name, sched, (x,), labels, needles, PeerTimeoutError, within)


def scenario_bcast(rank: int, pp: int) -> None:
    collective_failure(rank, "bcast", "broadcast", "BCAST", "central")


def scenario_gradreduce(rank: int, pp: int) -> None:
    collective_failure(rank, "gradreduce", "all_reduce_sum", "GRADreduce", "owner")


def slow_first_compile(stall_s: float) -> tuple[dict[str, bool], Callable[[], None]]:
    """Make the first kernel this process compiles in graph mode take ``stall_s`` longer (a sleep
    inside its first call, where it compiles); returns a flag set once it slept, and the undo."""
    from graph_exec.executors.graph import GraphExecutor

    original, state = GraphExecutor._prepare, {"slept": False}

    def prepare(self: Any, kernel: Callable[..., Any]) -> Callable[..., Any]:
        compiled = original(self, kernel)

        def first_call_sleeps(*args: Any, **kwargs: Any) -> Any:
            if not state["slept"]:
                state["slept"] = True
                time.sleep(stall_s)
            return compiled(*args, **kwargs)

        return first_call_sleeps

    GraphExecutor._prepare = prepare
    return state, lambda: setattr(GraphExecutor, "_prepare", original)


def check_slow_compile(rank: int, pp: int, stall_s: float) -> None:
    """Rank 1 compiles its first kernel for longer than ``timeout_s``: within
    ``compile_timeout_s`` it is a compiling peer, not a hung one; both steps finish everywhere."""
    cells = build(pp, "none").stages
    sched = ge.ScheduleMPipeTranspose(
        [ge.PipelineStage(cells[rank], rank, pp)],
        4,
        loss_fn=loss_fn,
        mode="graph",
        timeout_s=TIMEOUT_S,
        compile_timeout_s=4 * TIMEOUT_S,
    )
    state, undo = slow_first_compile(stall_s) if rank == 1 else ({"slept": True}, lambda: None)
    try:
        for step in range(2):
            x, labels = batch(8, seed=20 + step)
            sched.run(x, labels=labels)
        check("slow_compile.not_named_hung", True)
    except Exception as exc:
        check("slow_compile.not_named_hung", False, f"{type(exc).__name__}: {exc}")
    finally:
        undo()
    check("slow_compile.compiled_slowly", state["slept"])


def scenario_hang(rank: int, pp: int) -> None:
    """Rank 1 stalls in F1.0 for longer than the time-out: rank 0 times out waiting for it."""
    stall_s = TIMEOUT_S + 2 * TIMEOUT_SLACK_S
    sched, armed = armed_schedule(rank, pp, 1, lambda: time.sleep(stall_s))
    x, labels = healthy_step("hang", sched, seed=9)
    if armed is not None:
        armed.armed = True
        # Rank 1 wakes after rank 0 gave up (and usually left): its next exchange with rank 0
        # (seen: the send of Bsend1.0) times out.
        expect_step_failure(
            "hang",
            sched,
            (x,),
            labels,
            ["rank 1, step ", "peer rank 0: PeerTimeoutError"],
            PeerTimeoutError,
            within=(stall_s + TIMEOUT_S, stall_s + TIMEOUT_S + TIMEOUT_SLACK_S),
        )
    else:
        expect_step_failure(
            "hang",
            sched,
            (x,),
            labels,
            ["rank 0, step Brecv0.0, peer rank 1", "from rank 1"],
            PeerTimeoutError,
            within=(TIMEOUT_S, TIMEOUT_S + TIMEOUT_SLACK_S),
        )


def scenario_death(rank: int, pp: int) -> None:
    """Rank 1's process dies in F1.0 (exit code 0, so msrun does not stop the job for it)."""
    sched, armed = armed_schedule(rank, pp, 1, lambda: os._exit(0))
    x, labels = healthy_step("death", sched, seed=11)
    if armed is not None:
        armed.armed = True
        print("rank 1 dies now", flush=True)
        sched.run(x, labels=labels)
        check("death.survived", False, "the armed stage did not end the process")
    else:
        expect_step_failure(
            "death",
            sched,
            (x,),
            labels,
            # seen: the send of Fsend0.1 or the wait for Bsend1.0 times out; or MindSpore
            # raises "Send failed" first
            ["rank 0, step ", "peer rank 1: "],
            (PeerTimeoutError, RuntimeError),
            within=(0.0, TIMEOUT_S + TIMEOUT_SLACK_S),
        )


def scenario_p4(rank: int, pp: int) -> None:
    """Four ranks: rank 2 raises at F2.0; every rank stops and names rank 2, none waits it out."""
    sched, armed = armed_schedule(rank, pp, 2, explode)
    x, labels = healthy_step("p4_abort", sched, seed=13)
    if armed is not None:
        armed.armed = True
    cause = RuntimeError if rank == 2 else RemoteRankError  # rank 0 hears it relayed by rank 1
    needles = [f"rank {rank}, step ", "rank 2: step F2.0 raised RuntimeError: injected failure"]
    if rank == 2:
        needles[1] = "rank 2, step F2.0: RuntimeError: injected failure"
    expect_step_failure("p4_abort", sched, (x,), labels, needles, cause)


SCENARIOS: dict[str, tuple[int, Callable[[int, int], None]]] = {
    "setup": (2, scenario_setup),
    "graph_rank0": (2, scenario_graph_rank0),
    "bcast": (2, scenario_bcast),
    "gradreduce": (2, scenario_gradreduce),
    "hang": (2, scenario_hang),
    "death": (2, scenario_death),
    "p4": (4, scenario_p4),
}


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    ranks, scenario = SCENARIOS[sys.argv[1]]
    if get_group_size() != ranks:
        raise SystemExit(f"scenario {sys.argv[1]} needs {ranks} ranks, got {get_group_size()}")
    scenario(get_rank(), ranks)
    print(f"ALL DONE failures={failures}", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
