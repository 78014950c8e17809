"""What went wrong in a failed msrun job, in words: which rank died, how, when, and why.

msrun's own account is one line per dead worker in its output ("Worker process PID exit
with exception. Error code: -9") and a generic "Distributed job exited with exception". The
launcher records which pid ran which rank while the job runs; this module turns both into a
report that names the rank, its exit code or signal, the last step it finished (when the
caller can read steps from a log), the error a surviving rank raised itself (a peer time-out,
an abort notice), and the tail of every worker's log.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping

_WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
#: A Python exception line as a traceback ends with it: ``Name: message`` or ``pkg.Name: message``.
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b(?::.*)?$")
#: Left out of log tails: MindSpore's info/debug lines, blank lines, graph-exec's own progress
#: and status lines (their content is in the report's per-rank lines already).
_NOISE = re.compile(r"^\[(INFO|DEBUG)\]|^\s*$|^@@graph-exec")


def reported_exits(msrun_output: str) -> list[tuple[int, int]]:
    """``(pid, exit code)`` of every worker msrun reported as failed, in its order (negative: a
    signal)."""
    return [(int(m.group(1)), int(m.group(2))) for m in _WORKER_EXIT.finditer(msrun_output)]


def worker_exits(msrun_output: str, rank_of_pid: Mapping[int, int]) -> dict[int, int]:
    """``{rank: exit code}`` of every worker msrun reported as failed (negative: a signal)."""
    exits: dict[int, int] = {}
    for pid, code in reported_exits(msrun_output):
        if pid in rank_of_pid:
            exits.setdefault(rank_of_pid[pid], code)
    return exits


def is_stack_dump(code: int, timed_out: bool) -> bool:
    """Whether exit ``code`` is the launcher's own doing: after a time-out it sends every worker
    SIGABRT for a stack dump (``PYTHONFAULTHANDLER``), so a SIGABRT then says nothing of the rank."""
    return timed_out and code == -signal.SIGABRT


def exit_words(code: int) -> str:
    """``-9`` -> "killed by signal 9 (SIGKILL)", ``1`` -> "exited with code 1"."""
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-code}{name}"
    return f"exited with code {code}"


def own_error(log: str) -> str | None:
    """The last exception line a rank's log holds (``PeerTimeoutError: ...``), if any."""
    for line in reversed(log.splitlines()):
        if _EXCEPTION.match(line.strip()):
            return line.strip()
    return None


def failure_report(
    *,
    headline: str,
    worker_logs: Mapping[int, str],
    exits: Mapping[int, int],
    msrun_output: str,
    tail_lines: int,
    last_step: Callable[[str], str | None] | None = None,
    timed_out: bool = False,
    hung: tuple[int, str] | None = None,
) -> str:
    """The report: headline, one line per rank (fate, last step, own error), then log tails;
    ``hung``: ``(rank, why)`` of a rank that hung (whatever signal then ended it)."""
    parts = [headline]
    for rank in sorted(set(worker_logs) | set(exits)):
        log = worker_logs.get(rank, "")
        words = [f"rank {rank}:"]
        if hung is not None and rank == hung[0]:
            words.append(f"hung ({hung[1]})")
        elif rank in exits:
            words.append(f"died, {exit_words(exits[rank])}")
        elif timed_out:
            words.append("still running at the time-out (its stack is in its log)")
        elif exits:
            words.append("stopped after the failure above")
        else:
            words.append("ended")
        step = last_step(log) if last_step is not None else None
        if step is not None:
            words.append(f"; {step}")
        error = own_error(log)
        if error is not None:
            words.append(f"; its error: {error}")
        parts.append(" ".join(words).replace(" ;", ";"))
    if not worker_logs:  # msrun itself failed (bad arguments, no free port): its words
        parts.extend(msrun_output.splitlines()[-tail_lines:])
    for rank, text in sorted(worker_logs.items()):
        lines = [ln for ln in text.splitlines() if not _NOISE.search(ln)]
        parts.append(f"----- worker {rank} (last {min(tail_lines, len(lines))} of {len(lines)} lines) -----")
        parts.extend(lines[-tail_lines:] or ["(nothing else: no error, no traceback)"])
    return "\n".join(parts)
