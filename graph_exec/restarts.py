"""Automatic restarts of a failed job: what an attempt died of, and whether a restart can fix it.

A rank that is killed (a signal: the OOM killer, a crashed device driver, ``kill -9``), a rank
that hangs (its peers time out waiting for it and name it, or msrun's scheduler loses its
heartbeat) or a job that stops making progress (the launcher's time limit, or every failed rank
reporting a peer that went silent) is worth a relaunch from the latest complete checkpoint. Anything a
relaunch would meet again is not: bad arguments (exit code 2), a job whose ranks disagree
(:class:`~graph_exec.errors.ConfigurationMismatchError`), a corrupt or mismatching checkpoint,
an exception in the program, and the same step failing twice in a row for the same cause.

The decision is a pure function over plain data — exit codes, logs, earlier attempts — and
the loop (:func:`run_attempts`) takes the launch of one attempt as a function, so
:mod:`graph_exec.launch` stays about processes and both are tested without starting any.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from graph_exec.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from graph_exec.checkpoint.layout import MANIFEST, latest_checkpoint, step_dir
from graph_exec.errors import ConfigurationMismatchError, silent_peers
from graph_exec.launch_report import exit_words, is_stack_dump, own_error, reported_exits

#: Environment variable the launcher sets for every worker: the attempt number, 0, 1, ...
ATTEMPT_ENV = "GRAPH_EXEC_ATTEMPT"
#: Exit code of bad arguments (what ``argparse`` exits with): never retried.
EXIT_BAD_ARGUMENTS = 2
#: Exit code a worker uses for a failure no restart can fix (``graph-exec run``'s workers exit
#: with it on the errors below); never retried.
EXIT_NOT_RETRYABLE = 3
#: Errors that a restart would meet again; a rank whose log ends with one is not retried.
NOT_RETRYABLE_ERRORS = (ConfigurationMismatchError, CheckpointCorruptError, CheckpointMismatchError)

#: Causes of a failed attempt, and which of them a restart may fix.
SIGNAL, TIMEOUT, PEER_TIMEOUT, HUNG = "signal", "timeout", "peer-timeout", "hung"
BAD_ARGUMENTS, NOT_RETRYABLE, ERROR = "bad-arguments", "not-retryable", "error"
RETRYABLE = frozenset({SIGNAL, TIMEOUT, PEER_TIMEOUT, HUNG})

_NOT_RETRYABLE_LINE = re.compile(
    r"^(?:[\w]+\.)*(" + "|".join(error.__name__ for error in NOT_RETRYABLE_ERRORS) + r")\b"
)
#: A rank's own time-out waiting for a peer: the error itself, or the plan step it failed.
_PEER_TIMEOUT_LINE = re.compile(
    r"^(?:\w+\.)*(?:PeerTimeoutError|PipelineStepError: rank \d+, step [^:]*: PeerTimeoutError)\b"
)
#: msrun's scheduler naming the first worker whose heartbeat stopped (a stopped process).
_HEARTBEAT_LOST = re.compile(r"worker (\d+) is the first one timed out")


@dataclass(frozen=True)
class Failure:
    """Why one attempt failed: ``cause`` (one of the constants above), the rank at fault (``None``
    when none can be named), its exit code (negative: the signal that killed it), the step it
    failed in (the number of steps it had finished; ``None`` when unknown) and the same in words."""

    cause: str
    rank: int | None
    exit: int | None
    step: int | None
    detail: str

    @property
    def retryable(self) -> bool:
        return self.cause in RETRYABLE


@dataclass(frozen=True)
class Attempt:
    """One attempt of a launch, as :attr:`graph_exec.launch.LaunchResult.attempts` lists it.

    ``resumed_from``: the latest complete checkpoint step when the attempt started (``None``
    without a checkpoint directory, 0 when it held none). For a failed attempt,
    ``steps_redone`` is how many steps it had finished beyond the checkpoint the next attempt
    resumes from, and ``seconds_lost`` its wall time after that checkpoint was written (all of
    it when the checkpoint is older than the attempt): work thrown away plus the detection.
    """

    index: int
    cause: str  #: "ok" or a :class:`Failure` cause
    rank: int | None
    exit: int | None
    failed_step: int | None
    detail: str
    resumed_from: int | None
    steps_redone: int | None
    seconds: float
    seconds_lost: float | None
    retried: bool
    reason: str  #: why it was or was not retried ("" when it succeeded)
    began: float | None = None  #: when it started (wall clock, ``time.time()``)

    @property
    def ok(self) -> bool:
        return self.cause == "ok"

    def describe(self) -> str:
        """One line: what happened, where it started, what it cost."""
        start = {None: "", 0: "; started from step 0"}.get(
            self.resumed_from, f"; resumed from checkpoint step {self.resumed_from}"
        )
        if self.ok:
            return f"attempt {self.index}: finished{start}; {self.seconds:.1f} s"
        cost = f"; {self.seconds:.1f} s"
        if self.seconds_lost is not None:
            cost += f", {self.seconds_lost:.1f} s lost"
        if self.steps_redone is not None:
            cost += f", {self.steps_redone} step{'s' if self.steps_redone != 1 else ''} to redo"
        return f"attempt {self.index}: {self.detail}{start}{cost}; {self.reason}"


@dataclass(frozen=True)
class Evidence:
    """What the launcher saw of one failed attempt, as :func:`classify`'s rules read it.

    ``exits``: ``{rank: exit code}`` in the order the ranks died (negative: a signal), without
    the SIGABRTs of the launcher's own stack dumps after a time-out; ``reported``: the exit codes
    msrun logged, filtered alike; ``errors``: each rank's last exception line; ``steps``: steps
    each rank finished (where the caller can read them from a log).
    """

    returncode: int
    timed_out: bool
    exits: Mapping[int, int]
    reported: Sequence[int]
    worker_logs: Mapping[int, str]
    scheduler_log: str
    errors: Mapping[int, str]
    steps: Mapping[int, int | None]

    def failure(self, cause: str, rank: int | None, code: int | None, what: str) -> Failure:
        """The :class:`Failure`, with the step ``rank`` failed in (the least any rank finished
        when no rank is named)."""
        if rank is not None:
            step = self.steps.get(rank)
        else:
            step = min((s for s in self.steps.values() if s is not None), default=None)
        where = "" if step is None else f" in step {step + 1}"
        return Failure(cause, rank, code, step, what + where)

    @property
    def timed_out_ranks(self) -> dict[int, str]:
        """The ranks whose own error is a time-out waiting for a peer, and that error."""
        return {rank: text for rank, text in self.errors.items() if _PEER_TIMEOUT_LINE.match(text)}


#: One rule of :func:`classify`: the failure it recognises in the evidence, or ``None``.
Rule = Callable[[Evidence], Failure | None]


def _bad_arguments(ev: Evidence) -> Failure | None:
    """A rank exited with code 2, or msrun did before starting any (argparse's code)."""
    for rank, code in sorted(ev.exits.items()):
        if code == EXIT_BAD_ARGUMENTS:
            return ev.failure(BAD_ARGUMENTS, rank, code, f"rank {rank} exited with code 2 (bad arguments)")
    if not ev.worker_logs and ev.returncode == EXIT_BAD_ARGUMENTS and not ev.timed_out:
        return ev.failure(BAD_ARGUMENTS, None, ev.returncode, "msrun exited with code 2 (bad arguments)")
    return None


def _not_retryable_exit(ev: Evidence) -> Failure | None:
    """A rank exited with :data:`EXIT_NOT_RETRYABLE` (the harness's code for such errors)."""
    for rank, code in sorted(ev.exits.items()):
        if code == EXIT_NOT_RETRYABLE:
            said = f": {ev.errors[rank]}" if rank in ev.errors else ""
            return ev.failure(NOT_RETRYABLE, rank, code, f"rank {rank} exited with code {code}{said}")
    return None


def _not_retryable_error(ev: Evidence) -> Failure | None:
    """A rank's last error is one of :data:`NOT_RETRYABLE_ERRORS`, whatever its exit code."""
    for rank, text in sorted(ev.errors.items()):
        if _NOT_RETRYABLE_LINE.match(text):
            return ev.failure(NOT_RETRYABLE, rank, ev.exits.get(rank), f"rank {rank} failed: {text}")
    return None


def _hung_rank(ev: Evidence) -> Failure | None:
    """A rank that hung: its peers timed out waiting for it (their ``PeerTimeoutError`` names it,
    :func:`graph_exec.errors.silent_peers`) and it did not itself time out, or msrun's scheduler
    lost its heartbeat (a stopped process). Ahead of the signals, since the signals that end such
    a job (msrun's kill of the others, its scheduler's SIGTERM, the launcher's stack dumps) say
    nothing about its cause; but not a rank whose own death came first (a killed rank)."""
    waiting = ev.timed_out_ranks
    named = {peer for text in waiting.values() for peer in silent_peers(text)} - set(waiting)
    heartbeat = _HEARTBEAT_LOST.search(ev.scheduler_log)
    lost = int(heartbeat.group(1)) if heartbeat else None
    rank = min(named) if named else lost
    if rank is None:
        return None
    first = next(iter(ev.exits.items()), None)
    if first is not None and first[0] == rank and first[1] < 0:
        return None  # it died by itself first: the signal rule names it
    waiters = sorted(r for r, text in waiting.items() if rank in silent_peers(text))
    if waiters:
        who = ", ".join(map(str, waiters))
        why = f"rank{'s' if len(waiters) > 1 else ''} {who} timed out waiting for it ({waiting[waiters[0]]})"
    else:
        why = "msrun's scheduler lost its heartbeat"
    return ev.failure(HUNG, rank, None, f"rank {rank} hung: {why}")


def _killed(ev: Evidence) -> Failure | None:
    """A rank killed by a signal (the first to die is named); or, before the launcher learnt
    which rank a worker ran, the signal of msrun's own line."""
    killed = [(rank, code) for rank, code in ev.exits.items() if code < 0]
    if killed:
        rank, code = killed[0]
        return ev.failure(SIGNAL, rank, code, f"rank {rank} {exit_words(code)}")
    if not ev.exits:
        code = next((code for code in ev.reported if code < 0), None)
        if code is not None:
            return ev.failure(SIGNAL, None, code, f"a worker {exit_words(code)}")
    return None


def _time_limit(ev: Evidence) -> Failure | None:
    """The launcher's time limit ended the job."""
    return ev.failure(TIMEOUT, None, None, "the job ran past its time limit") if ev.timed_out else None


def _peer_timeout(ev: Evidence) -> Failure | None:
    """Every failed rank only saw a silent peer, without naming it."""
    failed = sorted(ev.exits) or sorted(ev.errors)
    waiting = ev.timed_out_ranks
    if not failed or not all(rank in waiting for rank in failed):
        return None
    rank = failed[0]
    return ev.failure(PEER_TIMEOUT, rank, ev.exits.get(rank), f"rank {rank} timed out: {ev.errors[rank]}")


def _program_error(ev: Evidence) -> Failure:
    """An error in the program: the rank with an error of its own rather than one that saw it
    fail; else msrun's exit code."""
    failed = sorted(ev.exits) or sorted(ev.errors)
    if not failed:
        return ev.failure(ERROR, None, ev.returncode, f"msrun {exit_words(ev.returncode)}")
    rank = next((r for r in failed if r not in ev.timed_out_ranks), failed[0])
    said = f": {ev.errors[rank]}" if rank in ev.errors else ""
    code = ev.exits.get(rank)
    how = exit_words(code) if code is not None else "failed"
    return ev.failure(ERROR, rank, code, f"rank {rank} {how}{said}")


#: :func:`classify`'s rules, first match wins: what no restart can fix, then a hung rank (before
#: the signals and the time limit that end its job), a killed rank, the time limit, a silent
#: peer nobody could name, and last an error in the program (which always matches).
RULES: tuple[Rule, ...] = (
    _bad_arguments,
    _not_retryable_exit,
    _not_retryable_error,
    _hung_rank,
    _killed,
    _time_limit,
    _peer_timeout,
    _program_error,
)


def classify(
    *,
    returncode: int,
    timed_out: bool,
    exits: Mapping[int, int],
    worker_logs: Mapping[int, str],
    msrun_output: str = "",
    scheduler_log: str = "",
    steps_done: Callable[[str], int | None] | None = None,
) -> Failure | None:
    """What an attempt died of (``None``: it succeeded), from what the launcher saw: the first
    of :data:`RULES` that recognises it.

    ``exits`` is in the order the ranks died (the first killed rank is named); after a time-out
    the SIGABRTs of the launcher's stack dumps are left out of it and of msrun's reported exits
    (:func:`~graph_exec.launch_report.is_stack_dump`). ``scheduler_log`` is msrun's scheduler's
    log (it names a rank whose heartbeat stopped); ``steps_done(log)`` reads from a worker's log
    how many steps it finished.
    """
    if returncode == 0 and not timed_out:
        return None
    errors = {rank: own_error(log) for rank, log in worker_logs.items()}
    evidence = Evidence(
        returncode=returncode,
        timed_out=timed_out,
        exits={r: c for r, c in exits.items() if not is_stack_dump(c, timed_out)},
        reported=[c for _, c in reported_exits(msrun_output) if not is_stack_dump(c, timed_out)],
        worker_logs=worker_logs,
        scheduler_log=scheduler_log,
        errors={rank: text for rank, text in errors.items() if text is not None},
        steps={rank: steps_done(log) for rank, log in worker_logs.items()} if steps_done else {},
    )
    for rule in RULES:
        found = rule(evidence)
        if found is not None:
            return found
    raise AssertionError("the last rule always matches")  # pragma: no cover


R = TypeVar("R", bound="AttemptResult")

_NOT_RETRIED = {
    BAD_ARGUMENTS: "bad arguments stay bad",
    NOT_RETRYABLE: "a restart would meet the same error",
    ERROR: "an error in the program, not a lost rank",
}


def decide(failures: Sequence[Failure], max_restarts: int) -> tuple[bool, str]:
    """Whether to relaunch after ``failures[-1]`` (every failure so far, oldest first), and why.

    Retried: a retryable cause, not the same cause (kind, rank, exit code) in the same known step
    as the attempt before, while fewer than ``max_restarts`` restarts were made.
    """
    if not failures:
        raise ValueError("decide() needs at least the failure of the last attempt")
    last = failures[-1]
    if not last.retryable:
        return False, f"not retried: {_NOT_RETRIED.get(last.cause, last.cause)}"
    if len(failures) > 1:
        before = failures[-2]
        same = (before.cause, before.rank, before.exit) == (last.cause, last.rank, last.exit)
        if same and last.step is not None and before.step == last.step:
            return False, f"not retried: step {last.step + 1} failed twice in a row for the same cause"
    made = len(failures) - 1
    if made >= max_restarts:
        if max_restarts == 0:
            return False, "not retried: restarts are off"
        return False, f"not retried: the restart limit ({max_restarts}) is reached"
    return True, f"restarted ({made + 1} of {max_restarts})"


class AttemptResult(Protocol):
    """What :func:`run_attempts` reads of one attempt (a :class:`graph_exec.launch.LaunchResult`)."""

    returncode: int
    timed_out: bool
    seconds: float
    output: str
    worker_logs: dict[int, str]
    exits: dict[int, int]
    scheduler_log: str


def run_attempts(
    attempt: Callable[[int], tuple[R, bool]],
    *,
    max_restarts: int,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    steps_done: Callable[[str], int | None] | None = None,
    before_restart: Callable[[int], str | None] | None = None,
    exit_wait_s: float = 0.0,
) -> tuple[R, list[Attempt]]:
    """Run ``attempt(0)``, and again with 1, 2, ... while :func:`decide` says so.

    ``attempt(i)`` runs the job once and returns its result and whether every process of it is
    gone (a relaunch needs that). ``before_restart(i)`` runs before attempt ``i > 0`` and may
    return a reason not to run it. Returns the last attempt's result and every attempt's record.
    """
    folder = None if checkpoint_dir is None else Path(checkpoint_dir)
    failures: list[Failure] = []
    attempts: list[Attempt] = []
    while True:
        index = len(attempts)
        resumed = _latest(folder)
        began = time.time()
        result, gone = attempt(index)
        failure = classify(
            returncode=result.returncode,
            timed_out=result.timed_out,
            exits=result.exits,
            worker_logs=result.worker_logs,
            msrun_output=result.output,
            scheduler_log=result.scheduler_log,
            steps_done=steps_done,
        )
        if failure is None:
            attempts.append(
                Attempt(
                    index,
                    "ok",
                    None,
                    None,
                    None,
                    "finished",
                    resumed,
                    None,
                    result.seconds,
                    None,
                    False,
                    "",
                    began,
                )
            )
            return result, attempts
        failures.append(failure)
        retry, reason = decide(failures, max_restarts)
        if retry and not gone:
            retry, reason = False, f"not retried: processes of the attempt outlived it by {exit_wait_s:g} s"
        if retry and before_restart is not None:
            refusal = before_restart(index + 1)
            if refusal:
                retry, reason = False, f"not retried: {refusal}"
        attempts.append(
            _failed_attempt(index, failure, resumed, began, result.seconds, folder, retry, reason)
        )
        if not retry:
            return result, attempts
        print(f"graph-exec launch: {attempts[-1].describe()}; relaunching", file=sys.stderr, flush=True)


def _latest(folder: Path | None) -> int | None:
    """The step an attempt starting now resumes from: the latest complete checkpoint in ``folder``
    whose rank files match their checksums, as ``load_checkpoint`` chooses it (0: none yet;
    ``None``: no folder)."""
    if folder is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the debris of a save that died is expected here
        return latest_checkpoint(folder, verify=True) or 0


def _failed_attempt(
    index: int,
    failure: Failure,
    resumed: int | None,
    began: float,
    seconds: float,
    folder: Path | None,
    retried: bool,
    reason: str,
) -> Attempt:
    """The record of a failed attempt that began at ``began`` (wall clock) and ran ``seconds``:
    what it cost, measured from the checkpoint the next attempt starts from."""
    resume = _latest(folder)
    redone = lost = None
    if folder is not None and resume is not None:
        if failure.step is not None:
            redone = max(0, failure.step - resume)
        lost = seconds
        manifest = step_dir(folder, resume) / MANIFEST
        written = manifest.stat().st_mtime if resume and manifest.exists() else None
        if written is not None and written > began:  # written by this attempt: the rest was lost
            lost = max(0.0, began + seconds - written)
    return Attempt(
        index,
        failure.cause,
        failure.rank,
        failure.exit,
        failure.step,
        failure.detail,
        resumed,
        redone,
        seconds,
        lost,
        retried,
        reason,
        began,
    )
