"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest

from graph_exec import device


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
