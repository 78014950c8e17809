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
