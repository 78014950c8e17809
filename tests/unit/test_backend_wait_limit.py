"""The CPU back end's own limit on a send or receive (``MS_CPU_COMM_OP_TIMEOUT``) follows the
first time-out a process asks for, unless the user chose one; point-to-point calls skip the
deadline thread only where that limit is no longer than the transport's time-out."""

from __future__ import annotations

import pytest

from graph_exec.transport.cpu_workarounds import (
    BACKEND_DEFAULT_TIMEOUT_S,
    BACKEND_TIMEOUT_ENV,
    backend_ends_waits,
    backend_wait_limit,
    bound_backend_waits,
)


def test_the_first_time_out_sets_the_limit_rounded_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "0")  # recorded, so the value set below is undone
    monkeypatch.delenv(BACKEND_TIMEOUT_ENV)
    assert backend_wait_limit() == BACKEND_DEFAULT_TIMEOUT_S
    bound_backend_waits(119.2)
    assert backend_wait_limit() == 120.0
    bound_backend_waits(3.5)  # later callers cannot change it: the back end read it already
    assert backend_wait_limit() == 120.0


def test_a_users_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "900")
    bound_backend_waits(60.0)
    assert backend_wait_limit() == 900.0


def test_an_unreadable_value_counts_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "soon")
    assert backend_wait_limit() == BACKEND_DEFAULT_TIMEOUT_S


def test_the_back_end_ends_waits_only_within_the_time_out(monkeypatch: pytest.MonkeyPatch, cpu_path) -> None:
    import mindspore as ms

    ms.set_context(device_target="CPU")
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "60")
    if not cpu_path.backend_bounds_waits:  # the device path never relies on the back end's limit
        assert not backend_ends_waits(60.0) and not backend_ends_waits(300.0)
        return
    assert backend_ends_waits(60.0)
    assert backend_ends_waits(59.5)  # the limit is a whole number of seconds: 60 covers 59.5
    assert backend_ends_waits(300.0)  # it fails earlier than asked, with or without a thread
    assert not backend_ends_waits(10.0)  # it would keep waiting after the deadline
    monkeypatch.delenv(BACKEND_TIMEOUT_ENV)
    assert not backend_ends_waits(10.0)  # its default, 30 s
