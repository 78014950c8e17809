"""``graph-exec run``'s own worker with a test hook that kills a rank at a chosen step.

``GRAPH_EXEC_TEST_KILL=ATTEMPT:RANK:STEP[:save|:stop][,...]``: in attempt ``ATTEMPT`` (the
launcher's ``GRAPH_EXEC_ATTEMPT``) rank ``RANK`` sends itself SIGKILL right before training step
``STEP`` (0-based) or, with ``:save``, while saving the checkpoint due after step ``STEP``: its
rank file written under its temporary name, not yet published; with ``:stop`` it sends itself
SIGSTOP instead, right before step ``STEP``: a hung rank (alive, silent, its heartbeat stopped);
with ``:nan`` it lives on but every gradient of step ``STEP`` turns NaN on that rank, between the
schedule's ``run()`` and the optimizer (a NaN step).
The line it prints first ends with the wall-clock time (``at <time.time()>``). Only this test worker reads the variable;
the library knows nothing of it. Without it, this is exactly ``graph_exec/harness/worker.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from graph_exec.harness import worker
from graph_exec.restarts import ATTEMPT_ENV

KILL_ENV = "GRAPH_EXEC_TEST_KILL"


def planned_kill() -> tuple[int, str] | None:
    """``(step, how)`` at which this process must die or stop in this attempt, if any (``how``:
    ``""``, ``"save"``, ``"stop"`` or ``"nan"``)."""
    attempt, rank = os.environ.get(ATTEMPT_ENV), os.environ.get("RANK_ID")
    for item in filter(None, os.environ.get(KILL_ENV, "").split(",")):
        when, who, step, *how = item.split(":")
        if when == attempt and who == rank and os.environ.get("MS_ROLE") == "MS_WORKER":
            return int(step), "".join(how)
    return None


def die(where: str, sig: signal.Signals = signal.SIGKILL) -> None:
    word = "STOP" if sig == signal.SIGSTOP else "KILL"
    who = f"rank {os.environ['RANK_ID']} attempt {os.environ[ATTEMPT_ENV]}"
    print(f"TEST {word}: {who} {where} at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), sig)


def poison_next_run(schedule) -> None:
    """Make every gradient of ``schedule``'s next ``run()`` NaN, in place, once it returns."""
    import mindspore as ms

    run = schedule.run

    def poisoned(*args, **kwargs):
        del schedule.run  # back to the method
        out = run(*args, **kwargs)
        for grad in schedule.grads().values():
            grad.copy_(ms.ops.full_like(grad, float("nan")))
        print(
            f"TEST NAN: rank {os.environ['RANK_ID']} attempt {os.environ[ATTEMPT_ENV]} at {time.time():.3f}",
            flush=True,
        )
        return out

    schedule.run = poisoned


def install(step: int, how: str) -> None:
    """Patch the harness (this process only) so that it dies where :func:`planned_kill` says."""
    from graph_exec.checkpoint import state
    from graph_exec.harness import training

    original_step, original_write = training.Trainer.step, state.write
    current = {"step": -1}

    def step_then_maybe_die(self: training.Trainer, index: int):
        current["step"] = index
        if index == step and how == "nan":
            poison_next_run(self.schedule)
        elif index == step and how != "save":
            die(f"before step {index}", signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        return original_step(self, index)

    def write_then_maybe_die(tensors, path):
        original_write(tensors, path)
        if current["step"] == step and how == "save":
            die(f"while saving after step {step} (rank file written, not published)")

    training.Trainer.step = step_then_maybe_die
    state.write = write_then_maybe_die


if __name__ == "__main__":
    kill = planned_kill()
    if kill is not None:
        install(*kill)
    sys.exit(worker.main(sys.argv[1:]))
