"""Fixtures shared by every test directory, and which tests share a pytest-xdist worker."""

from __future__ import annotations

import os
from typing import Any

import pytest

from graph_exec import device
from graph_exec.transport.cpu_workarounds import BACKEND_TIMEOUT_ENV
from tests.multirank.launch_groups import GROUPS

#: ``GRAPH_EXEC_TEST_GROUPS=0``: every multi-rank suite launches alone (tests/multirank/conftest.py:
#: to tell a suite's failure from an earlier member's leftovers, or to time the launches apart).
GROUPS_ENV = "GRAPH_EXEC_TEST_GROUPS"


def launch_groups() -> dict[str, str]:
    """``{node id: launch group}`` of every member of a grouped msrun launch (none when the
    groups are switched off)."""
    if os.environ.get(GROUPS_ENV) == "0":
        return {}
    return {f"tests/multirank/{m.test}": name for name, members in GROUPS.items() for m in members}


def worker_scope(nodeid: str, groups: dict[str, str]) -> str:
    """What ``nodeid`` must share a pytest-xdist worker with: its launch group, else its file.

    pyproject's addopts run the suite on two workers: most of a multi-rank test is waiting
    (start-up, peers, time-outs), so a second stream of tests fills the idle core. The members
    of one grouped msrun launch must run on one worker (the first to run launches them all), and
    the tests of one file share its module-scoped fixtures (else each worker builds them again).
    """
    return groups.get(nodeid, nodeid.split("::")[0])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Scopes by :func:`worker_scope`. Not ``--dist loadgroup`` with ``xdist_group`` marks: with
    pytest 9 that silently stops grouping (pytest-xdist issue 1386: it renames node ids through a
    field pytest no longer reads), and the launch groups ran twice, once per worker."""
    from xdist.scheduler import LoadScopeScheduling

    groups = launch_groups()

    class ByLaunchGroupOrFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid, groups)

    return ByLaunchGroupOrFile(config, log)


@pytest.fixture(autouse=True)
def _backend_wait_limit_kept_to_its_test() -> Any:
    """Undo a back-end wait limit a test's in-process transport set in ``os.environ``.

    :func:`~graph_exec.transport.bound_backend_waits` sets ``MS_CPU_COMM_OP_TIMEOUT`` for the
    process that builds a transport, and jobs launched later from the same process inherit it.
    A unit test's fake two-rank transport (10 s) left it behind on its pytest-xdist worker, so the
    hung-rank restart tests launched there had MindSpore fail the waiting rank's barrier after
    10 s instead of their 20 s peer deadline: a program error, not a hung rank, and no restart.
    """
    before = os.environ.get(BACKEND_TIMEOUT_ENV)
    yield
    if before is None:
        os.environ.pop(BACKEND_TIMEOUT_ENV, None)
    else:
        os.environ[BACKEND_TIMEOUT_ENV] = before


@pytest.fixture(params=["fast paths", "device path"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> device.DevicePolicy:
    """Run a test once with the CPU fast paths and once with the device path's decisions.

    In one process only the decisions taken after this point change (accumulation, packing,
    storage checks, frames, receive slots): the dispatch mode was set when the process prepared
    MindSpore. The multi-rank suites run whole processes with ``GRAPH_EXEC_CPU_FAST_PATHS=0``.
    """
    chosen = device.DevicePolicy.for_target("CPU", request.param == "fast paths")
    monkeypatch.setattr(device, "_chosen", chosen)
    return chosen
