"""``graph_exec.launch.launch``: what it refuses before msrun starts, and how it reads a job's
failed workers — without starting msrun."""

from __future__ import annotations

import math
import subprocess

import pytest

import graph_exec.launch as launch_module
from graph_exec.launch import launch


@pytest.fixture
def no_msrun(monkeypatch):
    """Fail the test if anything is started."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"msrun was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("timeout_s", [-5, 0, math.nan, math.inf, "60"])
def test_a_time_limit_that_is_not_a_positive_number_is_refused_before_msrun(no_msrun, tmp_path, timeout_s):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with pytest.raises(ValueError, match=rf"timeout_s must be a number of seconds > 0, got {timeout_s!r}"):
        launch(script, nproc=2, log_dir=tmp_path / "logs", timeout_s=timeout_s)


def test_a_missing_script_is_named_before_msrun(no_msrun, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cannot launch '.*nowhere/train\.py': no such script file"):
        launch(tmp_path / "nowhere" / "train.py", nproc=2, log_dir=tmp_path / "logs", timeout_s=30)
    with pytest.raises(FileNotFoundError, match=r"no such script file"):  # a directory is no script
        launch(tmp_path, nproc=2, log_dir=tmp_path / "logs", timeout_s=30)


def test_the_launchers_stack_dumps_are_not_reported_as_deaths():
    output = "Worker process 11 exit with exception. Error code: -6\n"
    ranks = {11: 1, 10: 0}
    assert launch_module._failed_workers(output, ranks, {0: -6}, timed_out=True) == {}
    assert launch_module._failed_workers(output, ranks, {0: -9}, timed_out=True) == {0: -9}
    assert launch_module._failed_workers(output, ranks, {}, timed_out=False) == {1: -6}


def test_a_failure_report_names_the_hung_rank_not_the_signals_that_ended_it(tmp_path):
    waited = (
        "graph_exec.errors.PeerTimeoutError: timed out after 20 s in a barrier [waiting for global rank 1] "
        "(Recv failed.)"
    )
    result = launch_module.LaunchResult(
        1,
        False,
        23.0,
        tmp_path,
        "Worker process 10 exit with exception. Error code: 1\n",
        {0: f"Traceback (most recent call last):\n{waited}\n", 1: ""},
        exits={0: 1},
    )
    report = result.describe()
    assert "rank 1: hung (rank 0 timed out waiting for it (" in report, report
    assert "rank 0: died, exited with code 1; its error: " in report, report
