"""Automatic restarts of a failed job: what an attempt died of, and whether a restart can fix it.

A rank that is killed (a signal: the OOM killer, a crashed device driver, ``kill -9``) or a
job that stops making progress (the launcher's time limit, or every failed rank reporting a
peer that went silent) is worth a relaunch from the latest complete checkpoint. Anything a
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
from graph_exec.errors import ConfigurationMismatchError
from graph_exec.launch_report import exit_words, own_error, reported_exits

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
SIGNAL, TIMEOUT, PEER_TIMEOUT = "signal", "timeout", "peer-timeout"
BAD_ARGUMENTS, NOT_RETRYABLE, ERROR = "bad-arguments", "not-retryable", "error"
RETRYABLE = frozenset({SIGNAL, TIMEOUT, PEER_TIMEOUT})

_NOT_RETRYABLE_LINE = re.compile(
    r"^(?:[\w]+\.)*(" + "|".join(error.__name__ for error in NOT_RETRYABLE_ERRORS) + r")\b"
)
_PEER_TIMEOUT_LINE = re.compile(r"^(?:[\w]+\.)*PeerTimeoutError\b")


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
    without a checkpoint directory, 0 when there was none). For a failed attempt,
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


def classify(
    *,
    returncode: int,
    timed_out: bool,
    exits: Mapping[int, int],
    worker_logs: Mapping[int, str],
    msrun_output: str = "",
    steps_done: Callable[[str], int | None] | None = None,
) -> Failure | None:
    """What an attempt died of (``None``: it succeeded), from what the launcher saw.

    In this order: bad arguments (a rank exited with code 2), a failure no restart can fix (exit
    code :data:`EXIT_NOT_RETRYABLE`, or a rank's last error is one of :data:`NOT_RETRYABLE_ERRORS`),
    a rank killed by a signal, the launcher's time limit, ranks that only saw a silent peer
    (``PeerTimeoutError``), else an error in the program. ``exits`` is in the order msrun
    reported the deaths (the first killed rank is named); ``steps_done(log)`` reads from a
    worker's log how many steps it finished.
    """
    if returncode == 0 and not timed_out:
        return None
    steps = {rank: steps_done(log) for rank, log in worker_logs.items()} if steps_done else {}
    errors = {rank: own_error(log) for rank, log in worker_logs.items()}
    errors = {rank: text for rank, text in errors.items() if text is not None}

    def failure(cause: str, rank: int | None, code: int | None, what: str) -> Failure:
        if rank is not None:
            step = steps.get(rank)
        else:
            step = min((s for s in steps.values() if s is not None), default=None)
        where = "" if step is None else f" in step {step + 1}"
        return Failure(cause, rank, code, step, what + where)

    for rank, code in sorted(exits.items()):
        if code == EXIT_BAD_ARGUMENTS:
            return failure(BAD_ARGUMENTS, rank, code, f"rank {rank} exited with code 2 (bad arguments)")
    if not worker_logs and returncode == EXIT_BAD_ARGUMENTS and not timed_out:
        return failure(BAD_ARGUMENTS, None, returncode, "msrun exited with code 2 (bad arguments)")
    for rank, code in sorted(exits.items()):
        if code == EXIT_NOT_RETRYABLE:
            said = f": {errors[rank]}" if rank in errors else ""
            return failure(NOT_RETRYABLE, rank, code, f"rank {rank} exited with code {code}{said}")
    for rank, text in sorted(errors.items()):
        if _NOT_RETRYABLE_LINE.match(text):
            return failure(NOT_RETRYABLE, rank, exits.get(rank), f"rank {rank} failed: {text}")
    killed = [(rank, code) for rank, code in exits.items() if code < 0]  # msrun's order: the first died first
    if killed:
        rank, code = killed[0]
        return failure(SIGNAL, rank, code, f"rank {rank} {exit_words(code)}")
    if not exits:  # a worker died before the launcher saw which rank it ran: msrun's own line
        codes = [code for _, code in reported_exits(msrun_output)]
        if any(code < 0 for code in codes):
            code = next(code for code in codes if code < 0)
            return failure(SIGNAL, None, code, f"a worker {exit_words(code)}")
    if timed_out:
        return failure(TIMEOUT, None, None, "the job ran past its time limit")
    failed = sorted(exits) or sorted(errors)
    if failed and all(_PEER_TIMEOUT_LINE.match(errors.get(rank, "")) for rank in failed):
        rank = failed[0]
        return failure(PEER_TIMEOUT, rank, exits.get(rank), f"rank {rank} timed out: {errors[rank]}")
    if failed:  # the rank with an error of its own, rather than one that saw it fail
        rank = next((r for r in failed if not _PEER_TIMEOUT_LINE.match(errors.get(r, ""))), failed[0])
        said = f": {errors[rank]}" if rank in errors else ""
        code = exits.get(rank)
        how = exit_words(code) if code is not None else "failed"
        return failure(ERROR, rank, code, f"rank {rank} {how}{said}")
    return failure(ERROR, None, returncode, f"msrun {exit_words(returncode)}")


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
            steps_done=steps_done,
        )
        if failure is None:
            attempts.append(
                Attempt(
                    index, "ok", None, None, None, "finished", resumed, None, result.seconds, None, False, ""
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
    )
