"""MindSpore settings the library applies on CPU: synchronous dispatch and host tasks run on
the calling thread, unless the user chose otherwise."""

from __future__ import annotations

import os

import mindspore as ms
import pytest

from graph_exec import msenv


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``prepare_mindspore`` as in a new process, recording its ``launch_blocking`` calls."""
    calls: list[str] = []
    monkeypatch.setattr(msenv, "_prepared", None)
    monkeypatch.setattr(ms.runtime, "launch_blocking", lambda: calls.append("launch_blocking"))
    monkeypatch.delenv(msenv.HOST_BLOCKING_ENV, raising=False)
    return calls


def test_cpu_gets_blocking_launches_and_host_tasks_on_the_caller(fresh: list[str]) -> None:

    assert msenv.prepare_mindspore("CPU") == "CPU"
    assert fresh == ["launch_blocking"]
    assert os.environ[msenv.HOST_BLOCKING_ENV] == "1"
    msenv.prepare_mindspore("CPU")  # idempotent
    assert fresh == ["launch_blocking"]


def test_a_host_blocking_choice_of_the_user_is_kept(
    fresh: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv(msenv.HOST_BLOCKING_ENV, "0")
    msenv.prepare_mindspore("CPU")
    assert os.environ[msenv.HOST_BLOCKING_ENV] == "0"
