"""The restart decision (``graph_exec.restarts``): what an attempt died of, whether it is
retried, and the attempt loop over fake attempts — no msrun, no MindSpore."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from graph_exec.checkpoint import layout
from graph_exec.cli.jobs import last_finished_step, steps_finished
from graph_exec.errors import silent_peers_note
from graph_exec.report.job import PROGRESS
from graph_exec.restarts import (
    BAD_ARGUMENTS,
    ERROR,
    EXIT_NOT_RETRYABLE,
    HUNG,
    NOT_RETRYABLE,
    PEER_TIMEOUT,
    SIGNAL,
    TIMEOUT,
    Failure,
    classify,
    decide,
    run_attempts,
)

PEER_TIMEOUT_LINE = "graph_exec.errors.PeerTimeoutError: rank 0 waited 100 s for rank 1 (Frecv 1.0)"
STEP_ERROR_LINE = "graph_exec.errors.PipelineStepError: rank 1 failed in F 1.0: ValueError: bad shape"


#: A rank's last error after it waited in vain for rank ``peer`` (as the schedule raises it).
def waited_for(rank: int, *peers: int) -> str:
    return (
        f"graph_exec.errors.PipelineStepError: rank {rank}, step F 1.2, peer rank {peers[0]}: PeerTimeoutError: "
        f"rank {rank} got no message from rank {peers[0]} while waiting for Fsend1.2: MindSpore gave up after "
        f"20 s (Recv failed.) {silent_peers_note(peers)}"
    )


#: msrun's scheduler, when worker 1 stopped sending heartbeats (as MindSpore 2.10 words it).
HEARTBEAT_LOST = (
    "[ERROR] DISTRIBUTED(7169,7fbc,python):2026-12-03-13:29:32.171.896 [meta_server_node.cc:548] "
    "UpdateTopoState] The node: 1 is timed out. It may exit with exception, please check this node's log.\n"
    "RuntimeError: The total number of timed out node is 1. Timed out node list is: [const vector]{1}, "
    "worker 1 is the first one timed out, please check its log.\n"
)
CORRUPT_LINE = "graph_exec.checkpoint.errors.CheckpointCorruptError: ckpt/step_3/rank_1.ckpt does not match"


def log(*lines: str, steps: int | None = None, resumed: int | None = None) -> str:
    """A worker log: progress lines (``resumed``, then steps up to ``steps``), then ``lines``."""
    out = []
    if resumed is not None:
        out.append(PROGRESS + f'{{"run": "run", "resumed": {resumed}, "seconds": 0.1}}')
    for step in range(resumed or 0, steps or 0):
        out.append(PROGRESS + f'{{"run": "run", "step": {step}, "loss": 1.0, "seconds": 0.1}}')
    if lines:
        out += ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', *lines]
    return "\n".join(out)


def failed(**kwargs) -> Failure | None:
    kwargs.setdefault("returncode", 1)
    kwargs.setdefault("timed_out", False)
    kwargs.setdefault("exits", {})
    kwargs.setdefault("worker_logs", {})
    return classify(steps_done=steps_finished, **kwargs)


def test_a_successful_attempt_has_no_failure():
    assert classify(returncode=0, timed_out=False, exits={}, worker_logs={0: "", 1: ""}) is None


def test_a_killed_rank_is_named_with_its_signal_and_step():
    found = failed(exits={1: -9, 0: 1}, worker_logs={0: log(PEER_TIMEOUT_LINE, steps=7), 1: log(steps=6)})
    assert found == Failure(SIGNAL, 1, -9, 6, "rank 1 killed by signal 9 (SIGKILL) in step 7")
    assert found.retryable


def test_a_rank_killed_before_its_pid_was_seen_is_still_a_signal():
    output = "Worker process 4242 exit with exception. Error code: -11\n"
    found = failed(exits={}, worker_logs={0: log(steps=2), 1: log(steps=2)}, msrun_output=output)
    assert (found.cause, found.rank, found.exit, found.step) == (SIGNAL, None, -11, 2)
    assert found.detail == "a worker killed by signal 11 (SIGSEGV) in step 3"


def test_a_time_out_is_retryable_and_names_the_slowest_rank_step():
    found = failed(timed_out=True, returncode=-9, worker_logs={0: log(steps=5), 1: log(steps=4)})
    assert (found.cause, found.rank, found.step, found.retryable) == (TIMEOUT, None, 4, True)


def test_ranks_that_only_saw_a_silent_peer_are_a_peer_timeout():
    found = failed(exits={0: 1}, worker_logs={0: log(PEER_TIMEOUT_LINE, steps=3), 1: log(steps=3)})
    assert (found.cause, found.rank, found.exit, found.retryable) == (PEER_TIMEOUT, 0, 1, True)
    assert "PeerTimeoutError" in found.detail


def test_a_hung_rank_is_named_by_the_peer_that_timed_out_waiting_for_it():
    """Rank 1 stopped: rank 0 timed out and exited 1, then msrun SIGKILLed the stopped rank 1."""
    for waiting, hung in ((0, 1), (1, 0)):
        found = failed(
            exits={waiting: 1},
            worker_logs={waiting: log(waited_for(waiting, hung), steps=7), hung: log(steps=7)},
            msrun_output="Worker process 4242 exit with exception. Error code: 1\n",
        )
        assert (found.cause, found.rank, found.exit, found.step, found.retryable) == (
            HUNG,
            hung,
            None,
            7,
            True,
        )
        assert found.detail.startswith(f"rank {hung} hung: rank {waiting} timed out waiting for it (")
        assert found.detail.endswith(") in step 8")


def test_a_hung_rank_wins_over_the_signals_and_the_time_limit_that_end_its_job():
    logs = {0: log(waited_for(0, 1), steps=4), 1: log(steps=4)}
    # msrun's scheduler lost the stopped rank's heartbeat and the healthy rank got a SIGTERM
    found = failed(
        exits={0: -15}, worker_logs={0: log(steps=4), 1: log(steps=4)}, scheduler_log=HEARTBEAT_LOST
    )
    assert (found.cause, found.rank, found.detail) == (
        HUNG,
        1,
        "rank 1 hung: msrun's scheduler lost its heartbeat in step 5",
    )
    # the launcher's time limit struck while the waiting rank was being stack-dumped
    found = failed(timed_out=True, returncode=-9, exits={0: -6}, worker_logs=logs)
    assert (found.cause, found.rank) == (HUNG, 1)


def test_a_rank_several_peers_waited_for_is_the_one_that_did_not_wait_itself():
    logs = {0: log(waited_for(0, 1)), 1: log(waited_for(1, 2)), 2: log(), 3: log(waited_for(3, 2))}
    found = failed(exits={1: 1, 0: 1, 3: 1}, worker_logs=logs)
    assert (found.cause, found.rank) == (HUNG, 2)
    assert found.detail.startswith("rank 2 hung: ranks 1, 3 timed out waiting for it (")


def test_a_killed_rank_its_peer_timed_out_on_is_a_signal_not_a_hang():
    logs = {0: log(waited_for(0, 1), steps=3), 1: log(steps=3)}
    found = failed(exits={1: -9, 0: 1}, worker_logs=logs)
    assert (found.cause, found.rank, found.exit) == (SIGNAL, 1, -9)


def test_the_launchers_stack_dumps_are_never_a_cause():
    """After a time-out the launcher SIGABRTs every worker: neither its exits nor msrun's line
    about one (a worker whose rank it never learnt) names a rank killed by SIGABRT."""
    output = "Worker process 4242 exit with exception. Error code: -6\n"
    logs = {0: log(steps=2), 1: log(steps=2)}
    found = failed(timed_out=True, returncode=-9, exits={}, worker_logs=logs, msrun_output=output)
    assert (found.cause, found.rank, found.exit) == (TIMEOUT, None, None)
    found = failed(timed_out=True, returncode=-9, exits={1: -6}, worker_logs=logs)
    assert found.cause == TIMEOUT
    found = failed(exits={}, worker_logs=logs, msrun_output=output)  # no time-out: a real SIGABRT
    assert (found.cause, found.exit) == (SIGNAL, -6)


@pytest.mark.parametrize(
    ("exits", "logs", "cause", "rank"),
    [
        ({0: 2, 1: 2}, {0: log("SystemExit: 2"), 1: ""}, BAD_ARGUMENTS, 0),
        ({1: EXIT_NOT_RETRYABLE, 0: 1}, {0: log(steps=0), 1: log(CORRUPT_LINE)}, NOT_RETRYABLE, 1),
        ({0: 1, 1: 1}, {0: log(CORRUPT_LINE), 1: log(CORRUPT_LINE)}, NOT_RETRYABLE, 0),
        (
            {0: 1},
            {0: log("graph_exec.errors.ConfigurationMismatchError: rank 1 has another plan")},
            NOT_RETRYABLE,
            0,
        ),
        ({0: -9, 1: 1}, {0: log(), 1: log(CORRUPT_LINE)}, NOT_RETRYABLE, 1),  # a restart meets it again
        ({0: 1, 1: 1}, {0: log(PEER_TIMEOUT_LINE), 1: log(STEP_ERROR_LINE)}, ERROR, 1),
        ({0: 1}, {0: log("ValueError: tokens must be int32")}, ERROR, 0),
    ],
)
def test_failures_a_restart_cannot_fix(exits, logs, cause, rank):
    found = failed(exits=exits, worker_logs=logs)
    assert (found.cause, found.rank, found.retryable) == (cause, rank, False)
    assert f"rank {rank}" in found.detail


def test_msrun_failing_by_itself():
    assert failed(returncode=2).cause == BAD_ARGUMENTS
    found = failed(returncode=1)
    assert (found.cause, found.rank, found.detail) == (ERROR, None, "msrun exited with code 1")


def test_a_load_that_fails_is_named_in_the_step_after_the_checkpoint():
    """A job resumed at step 4 whose load fails on every rank failed in step 5, not in step 1."""
    loading = PROGRESS + '{"run": "run", "resuming": 4}\n' + log(CORRUPT_LINE)
    found = failed(exits={0: 3, 1: 3}, worker_logs={0: loading, 1: loading})
    assert found.cause == NOT_RETRYABLE and found.step == 4
    assert found.detail.endswith(" in step 5"), found.detail
    assert last_finished_step(loading) == "no step finished: it failed while loading checkpoint step 4"
    loaded = loading.replace(
        '"resuming": 4}', '"resuming": 4}\n' + PROGRESS + '{"run": "run", "resumed": 4, "seconds": 0.1}'
    )
    assert last_finished_step(loaded) == "no step finished after loading checkpoint step 4"


def test_steps_finished_reads_progress_and_resume_lines():
    assert steps_finished("") == 0
    assert steps_finished(log(steps=4)) == 4
    assert steps_finished(log(resumed=6)) == 6
    assert steps_finished(log(resumed=6, steps=8)) == 8


def kill(rank: int, step: int | None, cause: str = SIGNAL, code: int | None = -9) -> Failure:
    return Failure(cause, rank, code, step, f"rank {rank} died")


@pytest.mark.parametrize(
    ("failures", "limit", "retry", "reason"),
    [
        ([kill(1, 7)], 1, True, "restarted (1 of 1)"),
        ([kill(1, 7)], 0, False, "not retried: restarts are off"),
        ([kill(1, 7), kill(1, 9)], 1, False, "not retried: the restart limit (1) is reached"),
        ([kill(1, 7), kill(1, 9)], 2, True, "restarted (2 of 2)"),
        ([kill(1, 7), kill(1, 7)], 5, False, "not retried: step 8 failed twice in a row for the same cause"),
        ([kill(1, 7), kill(0, 7)], 5, True, "restarted (2 of 5)"),  # another rank: not the same cause
        ([kill(1, 7), kill(1, 7, code=-11)], 5, True, "restarted (2 of 5)"),  # another signal
        ([kill(1, 7), kill(1, 3), kill(1, 7)], 5, True, "restarted (3 of 5)"),  # not in a row
        ([kill(1, None), kill(1, None)], 5, True, "restarted (2 of 5)"),  # unknown step: limit only
        (
            [kill(None, 4, TIMEOUT, None), kill(None, 4, TIMEOUT, None)],
            5,
            False,
            "not retried: step 5 failed twice in a row for the same cause",
        ),
        ([kill(1, 7, NOT_RETRYABLE, 3)], 5, False, "not retried: a restart would meet the same error"),
        ([kill(1, 7, BAD_ARGUMENTS, 2)], 5, False, "not retried: bad arguments stay bad"),
        ([kill(1, 7, ERROR, 1)], 5, False, "not retried: an error in the program, not a lost rank"),
        (
            [kill(1, 7), kill(1, 8, ERROR, 1)],
            5,
            False,
            "not retried: an error in the program, not a lost rank",
        ),
    ],
)
def test_decide(failures, limit, retry, reason):
    assert decide(failures, limit) == (retry, reason)


def test_decide_needs_a_failure():
    with pytest.raises(ValueError, match="at least the failure"):
        decide([], 1)


@dataclass
class FakeResult:
    returncode: int
    timed_out: bool = False
    seconds: float = 1.0
    output: str = ""
    worker_logs: dict[int, str] = field(default_factory=dict)
    exits: dict[int, int] = field(default_factory=dict)
    scheduler_log: str = ""


def complete_step(directory: Path, step: int, at: float) -> None:
    """A complete checkpoint (placeholder rank files) whose manifest was written at ``at``."""
    folder = layout.step_dir(directory, step)
    folder.mkdir(parents=True)
    (folder / "rank_0.ckpt").write_bytes(f"step {step}".encode())
    manifest = {
        "format": layout.FORMAT,
        "version": layout.VERSION,
        "step": step,
        "ranks": [{"file": "rank_0.ckpt", "sha256": layout.sha256_of(folder / "rank_0.ckpt")}],
    }
    layout.write_json_atomically(folder / layout.MANIFEST, manifest)
    os.utime(folder / layout.MANIFEST, (at, at))


def test_run_attempts_relaunches_and_records_every_attempt(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    seen = []

    def attempt(index: int) -> tuple[FakeResult, bool]:
        seen.append(index)
        if index == 0:  # checkpoint 3 written 2 s before the end of a 5 s attempt, rank 1 killed in step 5
            complete_step(ckpt, 3, time.time() + 3.0)
            logs = {0: log(PEER_TIMEOUT_LINE, steps=5), 1: log(steps=4)}
            return FakeResult(1, seconds=5.0, worker_logs=logs, exits={1: -9, 0: 1}), True
        return FakeResult(0, seconds=4.0, worker_logs={0: log(resumed=3, steps=12), 1: log(steps=12)}), True

    asked = []
    result, attempts = run_attempts(
        attempt,
        max_restarts=2,
        checkpoint_dir=ckpt,
        steps_done=steps_finished,
        before_restart=lambda i: asked.append(i),
    )
    assert seen == [0, 1] and asked == [1] and result.returncode == 0
    first, second = attempts
    assert (first.index, first.cause, first.rank, first.exit, first.failed_step) == (0, SIGNAL, 1, -9, 4)
    assert (first.resumed_from, first.steps_redone, first.retried) == (0, 1, True)
    assert first.seconds_lost == pytest.approx(2.0, abs=0.5)
    assert first.reason == "restarted (1 of 2)"
    assert (second.index, second.ok, second.resumed_from, second.seconds) == (1, True, 3, 4.0)
    err = capsys.readouterr().err
    assert "attempt 0: rank 1 killed by signal 9 (SIGKILL) in step 5; started from step 0" in err
    assert "1 step to redo; restarted (1 of 2); relaunching" in err
    assert second.describe() == "attempt 1: finished; resumed from checkpoint step 3; 4.0 s"


def test_run_attempts_stops_where_decide_or_the_caller_says(tmp_path):
    killed = FakeResult(1, worker_logs={0: log(steps=2), 1: log(steps=2)}, exits={1: -9})

    _, attempts = run_attempts(lambda i: (killed, True), max_restarts=1)
    assert [a.retried for a in attempts] == [True, False]
    assert attempts[-1].reason == "not retried: the restart limit (1) is reached"
    assert attempts[0].resumed_from is None and attempts[0].steps_redone is None  # no checkpoint dir

    _, attempts = run_attempts(lambda i: (killed, False), max_restarts=3, exit_wait_s=30)
    assert [a.reason for a in attempts] == ["not retried: processes of the attempt outlived it by 30 s"]

    _, attempts = run_attempts(lambda i: (killed, True), max_restarts=3, before_restart=lambda i: "no more")
    assert [a.reason for a in attempts] == ["not retried: no more"]

    corrupt = FakeResult(1, worker_logs={0: log(CORRUPT_LINE)}, exits={0: EXIT_NOT_RETRYABLE})
    _, attempts = run_attempts(lambda i: (corrupt, True), max_restarts=3, checkpoint_dir=tmp_path)
    assert len(attempts) == 1 and attempts[0].cause == NOT_RETRYABLE
    assert attempts[0].steps_redone is None and attempts[0].seconds_lost == 1.0  # no checkpoint: all lost


@pytest.mark.parametrize(
    ("code", "expected"), [("os.kill(os.getpid(), 9)", -9), ("os._exit(3)", 3), ("pass", 0)]
)
def test_the_launcher_reads_the_exit_code_of_a_dead_unreaped_process(code, expected):
    import subprocess
    import sys

    from graph_exec.launch import _processes, _zombie_exit

    child = subprocess.Popen([sys.executable, "-c", f"import os\n{code}"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        start = _processes()[child.pid][1]
        assert _zombie_exit(child.pid, start) == expected
        assert _zombie_exit(child.pid, "not its start time") is None
    finally:
        child.wait()
    assert _zombie_exit(child.pid, start) is None  # reaped: gone


def test_the_launcher_learns_the_rank_of_a_worker_first_seen_before_its_exec():
    # As msrun does: RANK_ID and MS_ROLE set in the launcher's own os.environ, the worker started
    # with a preexec_fn (slowed here), so that between fork and exec its /proc environ is the
    # launcher's original one, without them.
    import subprocess
    import sys

    from graph_exec.launch import _record

    launcher_code = (
        "import os, subprocess, sys, time\n"
        "os.environ['MS_ROLE'] = 'MS_WORKER'; os.environ['RANK_ID'] = '3'\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=lambda: time.sleep(1.0)).wait()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MS_ROLE", "RANK_ID")}
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], env=env, start_new_session=True)
    started: dict[int, str] = {}
    rank_of_pid: dict[int, int] = {}
    seen_before_its_exec = False
    try:
        deadline = time.monotonic() + 30
        while not rank_of_pid:
            assert time.monotonic() < deadline, "the worker's rank was never learnt"
            _record(launcher.pid, started, rank_of_pid)
            seen_before_its_exec |= bool(started) and not rank_of_pid
            time.sleep(0.05)
    finally:
        os.killpg(launcher.pid, 9)
        launcher.wait()
    assert seen_before_its_exec  # else this test did not meet the race it is about
    assert list(rank_of_pid.values()) == [3]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-restarts", "2"], "--max-restarts 2 needs --checkpoint-dir DIR"),
        (["--max-restarts", "-1"], "argument --max-restarts: invalid value '-1'"),
        (
            ["--max-restarts", "1", "--checkpoint-dir", "ckpt", "--nodes", "2", "--ranks", "4"],
            "--max-restarts needs a job on one host, not --nodes 2",
        ),
    ],
)
def test_graph_exec_run_refuses_restarts_it_cannot_make(argv, message, monkeypatch, capsys, tmp_path):
    from graph_exec.cli import jobs, main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(jobs, "launch", lambda *a, **k: pytest.fail("msrun was launched"))
    with pytest.raises(SystemExit) as exc:
        main(["run", "embed_lm", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_relaunched_job_resumes_from_the_latest_complete_checkpoint(tmp_path):
    from graph_exec.cli.run import resumed_job
    from graph_exec.report.job import JobSpec, RunSpec

    job = JobSpec(
        "embed_lm", "tiny", 2, 2, 4, 8, steps=11, warmup=1, runs=(RunSpec("run"),), save_every=3,
        checkpoint_dir=str(tmp_path),
    )  # fmt: skip
    said: list[str] = []
    assert resumed_job(job, said.append) == job  # no checkpoint yet: from step 0 again
    complete_step(tmp_path, 6, time.time())
    layout.step_dir(tmp_path, 9).mkdir()  # a save that died: not a checkpoint
    again = resumed_job(job, said.append)
    assert (again.first_step, again.warmup, again.steps, again.end_step) == (6, 1, 5, 12)
    assert said == []  # debris after a failure is expected: not worth a word
    complete_step(tmp_path, 12, time.time())
    assert (
        resumed_job(job, said.append)
        == "checkpoint step 12 is complete: the training finished, the job failed after it"
    )


def test_a_relaunch_falls_back_from_a_corrupt_latest_checkpoint_and_says_so(tmp_path):
    from graph_exec.cli.run import resumed_job
    from graph_exec.report.job import JobSpec, RunSpec

    job = JobSpec(
        "embed_lm", "tiny", 2, 2, 4, 8, steps=11, warmup=1, runs=(RunSpec("run"),), save_every=3,
        checkpoint_dir=str(tmp_path),
    )  # fmt: skip
    complete_step(tmp_path, 6, time.time())
    complete_step(tmp_path, 9, time.time())
    (layout.step_dir(tmp_path, 9) / "rank_0.ckpt").write_bytes(b"flipped bits")
    said: list[str] = []
    again = resumed_job(job, said.append)
    assert (again.first_step, again.end_step) == (6, 12)
    assert said[0] == (
        f"skipping corrupt checkpoint step 9 in {tmp_path}: rank_0.ckpt does not match the checksum "
        "recorded when the step completed (truncated or changed since)"
    )
    assert said[1].startswith(
        f"checkpoint step 9 set aside as {tmp_path / 'step_9.corrupt'} (its files failed"
    )
    assert not layout.step_dir(tmp_path, 9).exists()  # the relaunch can save step 9 again
    assert layout.latest_checkpoint(tmp_path) == 6
