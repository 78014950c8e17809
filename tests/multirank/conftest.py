"""Multi-rank test support: one helper launches a worker script under msrun.

Every launch has a wall-clock limit, so a hang fails the test instead of blocking CI, and a
failing launch puts every worker's log tail into the assertion message, so the traceback of
the rank that failed shows up in the test report.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from graph_exec.launch import LaunchResult, launch

WORKERS = Path(__file__).parent / "workers"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/multirank is a multi-rank test (a directory named `dist` would be
    skipped by pytest's default norecursedirs)."""
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.dist)


@pytest.fixture
def run_workers(tmp_path: Path) -> Callable[..., LaunchResult]:
    """``run_workers(script, nproc, *args, timeout_s=..., expect_ok=True, env=None)``."""

    def run(
        script: str,
        nproc: int,
        *args: str,
        timeout_s: float = 240,
        expect_ok: bool = True,
        env: dict[str, str] | None = None,
    ) -> LaunchResult:
        import os

        # Workers import shared test models as `tests.…`: put the repository root on their path.
        root = str(Path(__file__).resolve().parents[2])
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            **(env or {}),
        }
        result = launch(
            WORKERS / script, args, nproc=nproc, log_dir=tmp_path / "logs", timeout_s=timeout_s, env=full_env
        )
        if expect_ok and not result.ok:
            pytest.fail(result.describe(), pytrace=False)
        return result

    return run


def checks(result: LaunchResult, rank: int) -> set[str]:
    """The ``CHECK <name> OK`` lines a worker printed."""
    return {
        line.split()[1] for line in result.worker_logs.get(rank, "").splitlines() if line.startswith("CHECK ")
    }
