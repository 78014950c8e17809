"""The multi-rank harness itself: a FAIL line, a non-zero exit or a time-out fails the test.

Runs without msrun: ``launch`` is replaced by a stub returning a made-up result, so these
checks take milliseconds. ``tests/multirank/test_harness.py`` proves the same with real workers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graph_exec.launch import LaunchResult
from tests.multirank import conftest as harness


def result(logs: dict[int, str], returncode: int = 0, timed_out: bool = False) -> LaunchResult:
    return LaunchResult(returncode, timed_out, 1.0, Path("/nonexistent"), "", logs)


CLEAN = {0: "CHECK alpha OK\nnoise\n", 1: "CHECK beta OK\n"}


def test_only_ok_lines_count_as_checks() -> None:
    made_up = result({0: "CHECK alpha OK\nCHECK beta FAIL got 3\nCHECK gamma\nCHECKdelta OK\n  CHECK eps OK"})
    assert harness.checks(made_up, 0) == {"alpha", "eps"}
    assert harness.checks(made_up, 1) == set()
    assert harness.failed_checks(made_up) == ["rank 0: beta got 3"]


@pytest.mark.parametrize(
    ("logs", "returncode", "timed_out", "expect_ok", "problem"),
    [
        (
            {**CLEAN, 1: "CHECK beta FAIL wrong rank"},
            0,
            False,
            True,
            "FAIL line from rank 1: beta wrong rank",
        ),
        ({**CLEAN, 1: "CHECK beta FAIL wrong rank"}, 1, False, False, "FAIL line from rank 1: beta"),
        (CLEAN, 1, False, True, "exited with code 1"),
        (CLEAN, 0, True, True, "did not finish within its limit"),
        (CLEAN, -9, True, False, "did not finish within its limit"),
    ],
)
def test_each_problem_is_reported(logs, returncode, timed_out, expect_ok, problem) -> None:
    problems = harness.launch_problems(result(logs, returncode, timed_out), expect_ok)
    assert any(problem in p for p in problems), problems


def test_clean_job_and_expected_failure_have_no_problem() -> None:
    assert harness.launch_problems(result(CLEAN)) == []
    assert harness.launch_problems(result(CLEAN, returncode=1), expect_ok=False) == []


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch):
    """Make ``run_launch`` see ``outcome`` instead of starting msrun."""
    outcome: dict[str, LaunchResult] = {}

    def launch(script, args, **kwargs) -> LaunchResult:
        assert Path(script).parent == harness.WORKERS
        return outcome["result"]

    monkeypatch.setattr(harness, "launch", launch)
    monkeypatch.delenv(harness.FAST_PATHS_ENV, raising=False)  # fast paths unless device_path
    return outcome


@pytest.mark.parametrize(
    "bad",
    [
        result({**CLEAN, 0: "CHECK alpha OK\nCHECK x FAIL no error"}),
        result(CLEAN, returncode=2),
        result(CLEAN, timed_out=True),
    ],
)
def test_run_workers_fails_the_test(fake_launch, tmp_path: Path, bad: LaunchResult) -> None:
    fake_launch["result"] = bad
    with pytest.raises(pytest.fail.Exception):
        harness.run_launch(tmp_path, "any.py", 2)


def test_run_workers_passes_a_clean_job(fake_launch, tmp_path: Path) -> None:
    fake_launch["result"] = result(CLEAN)
    assert harness.checks(harness.run_launch(tmp_path, "any.py", 2), 1) == {"beta"}
    fake_launch["result"] = result(CLEAN, returncode=1)
    assert harness.run_launch(tmp_path, "any.py", 2, expect_ok=False).returncode == 1


DEVICE_PATH = "POLICY CPU (device path: GRAPH_EXEC_CPU_FAST_PATHS=0)\n"


@pytest.mark.parametrize(
    ("logs", "problem"),
    [
        (CLEAN, "rank 0 printed no POLICY line"),  # nothing proves the path
        ({0: DEVICE_PATH + CLEAN[0]}, "rank 1 printed no POLICY line"),  # one rank silent
        ({0: DEVICE_PATH, 1: "POLICY CPU (fast paths)\n"}, "rank 1 ran with 'POLICY CPU (fast paths)'"),
    ],
)
def test_a_device_path_launch_needs_every_rank_to_show_the_device_path(
    fake_launch, tmp_path: Path, logs: dict[int, str], problem: str
) -> None:
    fake_launch["result"] = result(logs)
    with pytest.raises(pytest.fail.Exception, match=re.escape(problem)):
        harness.run_launch(tmp_path, "any.py", 2, device_path=True)


def test_a_device_path_launch_whose_ranks_show_it_passes(fake_launch, tmp_path: Path) -> None:
    fake_launch["result"] = result({rank: DEVICE_PATH + log for rank, log in CLEAN.items()})
    assert harness.checks(harness.run_launch(tmp_path, "any.py", 2, device_path=True), 1) == {"beta"}


DONE = "CHECK alpha OK\nALL DONE failures=0\n"
TEARDOWN = (
    "Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n  <no Python frame>\n"
)


@pytest.mark.parametrize(
    ("logs", "timed_out", "retried"),
    [
        ({0: DONE, 1: DONE + TEARDOWN}, False, True),  # MindSpore's teardown race
        ({0: DONE, 1: TEARDOWN + DONE}, False, False),  # crashed before its last check
        ({0: DONE, 1: "CHECK alpha OK\n" + TEARDOWN}, False, False),  # never finished
        ({0: DONE, 1: DONE + "Fatal Python error: Segmentation fault\n  File x.py"}, False, False),
        ({0: DONE, 1: DONE + "CHECK beta FAIL late\n" + TEARDOWN}, False, False),
        ({0: DONE, 1: DONE + TEARDOWN}, True, False),
        ({0: DONE, 1: DONE}, False, False),  # exited non-zero for another reason
    ],
)
def test_only_a_crash_after_every_check_is_relaunched_once(monkeypatch, logs, timed_out, retried) -> None:
    launched = []

    def fake_launch(script, args, **kwargs):
        launched.append(kwargs["log_dir"])
        return result(logs, 1, timed_out) if len(launched) == 1 else result({0: DONE, 1: DONE})

    monkeypatch.setattr(harness, "launch", fake_launch)
    if retried:
        harness.run_launch(Path("/nonexistent"), "w.py", 2)
        assert launched == [Path("/nonexistent"), Path("/nonexistent/relaunch")]
    else:
        with pytest.raises(pytest.fail.Exception):
            harness.run_launch(Path("/nonexistent"), "w.py", 2)
        assert len(launched) == 1


def test_a_second_teardown_crash_fails_the_test(monkeypatch) -> None:
    monkeypatch.setattr(
        harness, "launch", lambda script, args, **kw: result({0: DONE, 1: DONE + TEARDOWN}, 1)
    )
    with pytest.raises(pytest.fail.Exception, match="exited with code 1"):
        harness.run_launch(Path("/nonexistent"), "w.py", 2)
