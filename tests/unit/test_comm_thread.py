"""The communication worker's deadlines, on its thread and on the caller's: a call that outlives
its time-out, or that the back end fails at the deadline, is a time-out and breaks the worker;
an earlier failure is handed on unchanged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from graph_exec.errors import CommunicationError, PeerTimeoutError
from graph_exec.transport.comm_thread import DEADLINE_SLACK_S, CommWorker

#: Short deadlines keep the test fast; DEADLINE_SLACK_S (1 s) sets how late "at the deadline" is.
TIMEOUT_S = 1.5


def failing_after(seconds: float, message: str = "Recv failed.") -> Callable[[], None]:
    def call() -> None:
        time.sleep(seconds)
        raise RuntimeError(message)

    return call


@pytest.mark.parametrize("where", ["thread", "here"])
def test_a_back_end_failure_at_the_deadline_is_a_time_out(where: str) -> None:
    worker = CommWorker()
    run = worker.run if where == "thread" else worker.run_here
    with pytest.raises(PeerTimeoutError, match=r"waiting for F0\.0.*Recv failed"):
        run(failing_after(TIMEOUT_S - DEADLINE_SLACK_S / 2), TIMEOUT_S, "waiting for F0.0")
    with pytest.raises(CommunicationError, match="unusable after an earlier failure"):
        run(lambda: None, TIMEOUT_S, "anything")


@pytest.mark.parametrize("where", ["thread", "here"])
def test_an_early_failure_is_handed_on(where: str) -> None:
    worker = CommWorker()
    run = worker.run if where == "thread" else worker.run_here
    with pytest.raises(RuntimeError, match="Send failed"):
        run(failing_after(0.0, "Send failed."), TIMEOUT_S, "sending F0.0")
    assert worker.broken is None
    assert run(lambda: 7, TIMEOUT_S, "anything") == 7


def test_the_thread_gives_up_at_the_deadline_on_a_call_that_never_returns() -> None:
    worker = CommWorker()
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"timed out after 0\.5 s waiting"):
        worker.run(release.wait, 0.5, "waiting")
    assert time.monotonic() - start < 0.5 + DEADLINE_SLACK_S
    release.set()
    assert worker.broken is not None


def test_calls_run_on_the_callers_thread_only_with_run_here() -> None:
    worker = CommWorker()
    caller = threading.get_ident()
    assert worker.run_here(threading.get_ident, TIMEOUT_S, "x") == caller
    assert worker.run(threading.get_ident, TIMEOUT_S, "x") != caller


def test_settle_waits_for_a_timed_out_call_to_end_within_its_bound() -> None:
    """A failed step settles its transport: the call that timed out is still running on the
    thread; settle is bounded while it runs and returns once it has ended (its error absorbed)."""
    worker = CommWorker()
    with pytest.raises(PeerTimeoutError):
        worker.run(failing_after(TIMEOUT_S, "AllReduce failed."), TIMEOUT_S / 3, "in all-reduce")
    began = time.monotonic()
    assert not worker.settle(0.2)  # still running: not settled, and not waited for past the bound
    assert time.monotonic() - began < 1.0
    drained = []

    def drain() -> None:  # after the stuck call, on the thread; its own error is dropped
        drained.append(True)
        raise RuntimeError("AllReduce failed.")

    assert worker.settle(2 * TIMEOUT_S, then=drain)
    assert drained == [True]
    assert worker.broken is not None  # settling does not make the worker usable again
