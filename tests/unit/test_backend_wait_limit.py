"""The CPU back end's own limit on a send or receive (``MS_CPU_COMM_OP_TIMEOUT``) follows the
first time-out a process asks for, unless the user chose one."""

from __future__ import annotations

import pytest

from graph_exec.transport.cpu_workarounds import (
    BACKEND_DEFAULT_TIMEOUT_S,
    BACKEND_TIMEOUT_ENV,
    backend_wait_limit,
    bound_backend_waits,
)


def test_the_first_time_out_sets_the_limit_with_a_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "0")  # recorded, so the value set below is undone
    monkeypatch.delenv(BACKEND_TIMEOUT_ENV)
    assert backend_wait_limit() == BACKEND_DEFAULT_TIMEOUT_S
    bound_backend_waits(120.0)
    assert backend_wait_limit() == 125.0
    bound_backend_waits(3.5)  # later callers cannot change it: the back end read it already
    assert backend_wait_limit() == 125.0


def test_a_users_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "900")
    bound_backend_waits(60.0)
    assert backend_wait_limit() == 900.0


def test_an_unreadable_value_counts_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_TIMEOUT_ENV, "soon")
    assert backend_wait_limit() == BACKEND_DEFAULT_TIMEOUT_S
