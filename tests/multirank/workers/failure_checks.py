"""Bad set-ups and a rank failing mid-step, on 2 ranks: every rank must report, nobody hangs.

Prints ``CHECK <name> OK`` per passed check. The set-up scenarios leave the message order
intact (every rank stops at the same collective), so they run first in the same job; the
mid-step failure ends the job.
"""

from __future__ import annotations

import time

from mindspore import nn
from mindspore.communication import get_rank, init

import graph_exec as ge
from graph_exec.errors import ConfigurationMismatchError, GraphExecError, PipelineStepError, RemoteRankError
from graph_exec.msenv import prepare_mindspore
from tests.pipeline_models import FEATURES, Projector, batch, build, loss_fn

TIMEOUT_S = 60.0


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"CHECK {name} {'OK' if ok else f'FAIL {detail}'}", flush=True)


class Exploding(nn.Cell):
    """Wraps a stage; once armed, its next forward raises (pynative mode runs it as Python)."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def construct(self, h):
        if self.armed:
            raise RuntimeError("injected failure")
        return self.inner(h)


def expect_setup_error(name: str, make, x, labels) -> None:
    start = time.monotonic()
    try:
        make().run(x, labels=labels)
        check(name, False, "no error")
    except (ConfigurationMismatchError, ValueError) as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
        check(name, time.monotonic() - start < TIMEOUT_S / 2, f"took {time.monotonic() - start:.1f} s")


def main() -> None:
    prepare_mindspore("CPU")
    init()
    rank = get_rank()
    x, labels = batch(8)
    model = build(2, "trainable")
    stage = [ge.PipelineStage(model.stages[rank], rank, 2)]

    def schedule(stages=stage, pre=model.preprocess, layers=1):
        return ge.ScheduleMPipeTranspose(stages, 4, pre, layers, loss_fn=loss_fn, timeout_s=TIMEOUT_S)

    # A replica whose parameter shapes differ: caught before the first broadcast.
    other = Projector()
    if rank == 1:
        other.a = nn.Dense(FEATURES, 5)
    other.update_parameters_name("pre.")
    expect_setup_error("replica_shapes_differ", lambda: schedule(pre=other), x, labels)
    # A rank without a preprocess module.
    expect_setup_error(
        "rank_without_preprocess",
        lambda: schedule(pre=None, layers=0) if rank == 1 else schedule(),
        x,
        labels,
    )
    # Rank 1 holds the wrong stage: it raises its own error, rank 0 is told.
    wrong = [ge.PipelineStage(model.stages[0], 0, 2)]
    expect_setup_error(
        "stages_do_not_fit_world", lambda: schedule(stages=wrong if rank == 1 else stage), x, labels
    )

    # A rank raising mid-step: both ranks report it (rank, step), quickly, and stop.
    cells = build(2, "none").stages
    if rank == 1:
        cells[1] = Exploding(cells[1])
    sched = ge.ScheduleMPipeTranspose(
        [ge.PipelineStage(cells[rank], rank, 2)], 4, loss_fn=loss_fn, mode="pynative", timeout_s=TIMEOUT_S
    )
    sched.run(x, labels=labels)
    check("healthy_step_first", True)
    if rank == 1:
        cells[1].armed = True
    start = time.monotonic()
    try:
        sched.run(x, labels=labels)
        check("mid_step_failure_reported", False, "no error")
    except PipelineStepError as exc:
        waited = time.monotonic() - start
        print(f"reported after {waited:.1f} s: {exc}", flush=True)
        if rank == 1:
            ok = exc.rank == 1 and exc.step == "F1.0" and "injected failure" in str(exc)
        else:
            ok = isinstance(exc.__cause__, RemoteRankError) and "rank 1" in str(exc) and "F1.0" in str(exc)
        check("mid_step_failure_reported", ok and waited < TIMEOUT_S / 2, exc)
    try:
        sched.run(x, labels=labels)
        check("refuses_after_failure", False, "ran")
    except GraphExecError as exc:
        check("refuses_after_failure", "restart" in str(exc), exc)


if __name__ == "__main__":
    main()
