"""A single daemon thread that performs communication calls, with deadlines.

MindSpore's blocking receives cannot be cancelled or given a timeout. Running them on a
helper thread lets the caller stop waiting after ``timeout_s`` and raise a proper error (with
rank, step and peer) instead of hanging forever. One thread keeps the calls in program order,
which the order-matched CPU backend requires. It is a daemon so that a call stuck on a dead
peer does not keep the process alive at exit; after a timeout the worker is marked broken
and refuses further work, because the stuck call may still consume a later message.

Where the back end itself ends a wait at the deadline (MindSpore's CPU back end, see
:func:`graph_exec.transport.cpu_workarounds.backend_ends_waits`), a call can skip the hand-off
to the thread (about 50 µs each way on a 2-core machine) and run on the caller's thread with
:meth:`CommWorker.run_here`. Either way a call that fails only once its deadline has passed is
reported as a time-out, whichever of the two limits fired first.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from graph_exec.errors import CommunicationError, PeerTimeoutError


class _Call:
    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


#: What a call is doing, for its error message: a string, or the string's words (joined only
#: if the call fails, since formatting a message for every transfer costs as much as the rest of
#: a small transfer's bookkeeping).
Doing = str | tuple[object, ...]


def describe(what: Doing) -> str:
    """The text of ``what``."""
    return what if isinstance(what, str) else " ".join(str(part) for part in what)


#: A call that fails this close to its deadline (or later) failed because the deadline passed.
DEADLINE_SLACK_S = 1.0


class CommWorker:
    """Runs callables one at a time on a daemon thread; the caller waits with a deadline."""

    def __init__(self, name: str = "graph_exec-comm") -> None:
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.broken: str | None = None

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the waiting caller, re-raised there
                call.error = exc
            call.done.set()

    def require_usable(self) -> None:
        """Raise if an earlier call timed out (its stuck call may still consume a message)."""
        if self.broken is not None:
            raise CommunicationError(f"communication is unusable after an earlier failure ({self.broken})")

    def run(self, fn: Callable[..., Any], timeout_s: float, what: Doing, *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker; raise :class:`PeerTimeoutError` after ``timeout_s``."""
        self.require_usable()
        call = _Call(functools.partial(fn, *args) if args else fn)
        start = time.monotonic()
        self._queue.put(call)
        if not call.done.wait(timeout_s):
            self.broken = f"timed out after {timeout_s:g} s {describe(what)}"
            raise PeerTimeoutError(self.broken)
        if call.error is not None:
            self._raise(call.error, time.monotonic() - start, timeout_s, what)
        return call.value

    def settle(self, timeout_s: float, then: Callable[[], Any] = lambda: None) -> bool:
        """Wait up to ``timeout_s`` until every call handed to the thread has ended (a timed-out
        one included, however it ends) and ``then`` has run after them on the thread, its error
        dropped; whether all that happened in time. Bypasses :meth:`require_usable`: this is the
        wait a failed step makes before it returns, not new communication."""
        marker = _Call(then)
        self._queue.put(marker)
        return marker.done.wait(timeout_s)

    def run_here(self, fn: Callable[..., Any], timeout_s: float, what: Doing, *args: Any) -> Any:
        """Run ``fn(*args)`` on the caller's thread, for a call that the back end itself ends
        after ``timeout_s``; its failure at the deadline becomes :class:`PeerTimeoutError`."""
        self.require_usable()
        start = time.monotonic()
        try:
            return fn(*args)
        except BaseException as exc:  # re-raised, as a time-out when the deadline had passed
            self._raise(exc, time.monotonic() - start, timeout_s, what)

    def _raise(self, error: BaseException, waited: float, timeout_s: float, what: Doing) -> NoReturn:
        """Re-raise ``error``; a time-out (or a back-end failure at the deadline) breaks the worker."""
        if isinstance(error, PeerTimeoutError):
            self.broken = str(error)
            raise error
        if isinstance(error, RuntimeError) and waited >= timeout_s - DEADLINE_SLACK_S:
            self.broken = f"timed out after {waited:.0f} s {describe(what)} ({str(error).strip()})"
            raise PeerTimeoutError(self.broken) from error
        raise error
