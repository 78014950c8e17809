"""Fixtures shared by every test directory, and which tests share a pytest-xdist worker."""

from __future__ import annotations

import os

import pytest

from graph_exec import device
from tests.multirank.launch_groups import GROUPS

#: ``GRAPH_EXEC_TEST_GROUPS=0``: every multi-rank suite launches alone (tests/multirank/conftest.py:
#: to tell a suite's failure from an earlier member's leftovers, or to time the launches apart).
GROUPS_ENV = "GRAPH_EXEC_TEST_GROUPS"
_SHARED_SCOPES = {"module", "class", "package"}


def worker_group(item: pytest.Item, launch_groups: dict[str, str]) -> str | None:
    """The ``xdist_group`` ``item`` must share a worker with, or ``None`` (any worker will do).

    pyproject's addopts run the suite on two workers (``-n 2 --dist loadgroup``): most of a
    multi-rank test is waiting (start-up, peers, time-outs), so a second stream of tests fills
    the idle core. Two kinds of tests must not be split: the members of one grouped msrun launch
    (tests/multirank/launch_groups.py: the first member to run launches them all), and tests
    that share a module- or class-scoped fixture (else each worker builds it again).
    """
    if item.nodeid in launch_groups:
        return launch_groups[item.nodeid]
    fixture_defs = getattr(item, "_fixtureinfo", None)
    defs = fixture_defs.name2fixturedefs.values() if fixture_defs else ()
    if any(d.scope in _SHARED_SCOPES for chain in defs for d in chain):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist renames the items it groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    launch_groups = (
        {}
        if os.environ.get(GROUPS_ENV) == "0"
        else {f"tests/multirank/{m.test}": name for name, members in GROUPS.items() for m in members}
    )
    for item in items:
        group = worker_group(item, launch_groups)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


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
