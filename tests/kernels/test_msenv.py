"""MindSpore settings the library applies on CPU: with the fast paths, synchronous dispatch and
host tasks run on the calling thread, unless the user chose otherwise; on the device path
(``GRAPH_EXEC_CPU_FAST_PATHS=0``) neither, so MindSpore's asynchronous dispatch is kept."""

from __future__ import annotations

import os

import mindspore as ms
import pytest

from graph_exec import device, msenv


@pytest.fixture(params=[True, False], ids=["fast paths", "device path"])
def fresh(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, list[str]]:
    """``prepare_mindspore`` as in a new process with the fast paths on or off, recording its
    ``launch_blocking`` calls."""
    calls: list[str] = []
    monkeypatch.setattr(msenv, "_prepared", None)
    monkeypatch.setattr(device, "_fast_paths", request.param)
    monkeypatch.setattr(device, "_chosen", None)
    monkeypatch.setattr(ms.runtime, "launch_blocking", lambda: calls.append("launch_blocking"))
    monkeypatch.delenv(msenv.HOST_BLOCKING_ENV, raising=False)
    return request.param, calls


def test_cpu_gets_blocking_launches_and_host_tasks_on_the_caller_only_with_fast_paths(fresh) -> None:
    fast, calls = fresh
    assert msenv.prepare_mindspore("CPU") == "CPU"
    assert calls == (["launch_blocking"] if fast else [])
    assert os.environ.get(msenv.HOST_BLOCKING_ENV) == ("1" if fast else None)
    msenv.prepare_mindspore("CPU")  # idempotent
    assert calls == (["launch_blocking"] if fast else [])


def test_a_host_blocking_choice_of_the_user_is_kept(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(msenv.HOST_BLOCKING_ENV, "0")
    msenv.prepare_mindspore("CPU")
    assert os.environ[msenv.HOST_BLOCKING_ENV] == "0"


@pytest.mark.parametrize(("target", "expected"), [("CPU", None), ("GPU", 3), ("Ascend", 3)])
def test_a_rank_selects_its_local_device_on_accelerators_only(
    monkeypatch: pytest.MonkeyPatch, target: str, expected: int | None
) -> None:
    monkeypatch.setenv("RANK_ID", "7")
    assert msenv.local_device_id(target, local_workers=4) == expected
    monkeypatch.delenv("RANK_ID")
    monkeypatch.setenv("DEVICE_ID", "3")  # what msrun exports: the local rank
    assert msenv.local_device_id(target) == expected
