"""What every benchmark script shares: the spread it reports, and launching itself on ranks.

Timings on these machines are noisy and sometimes bimodal, so every script reports p10/p50/p90
rather than a single median; one definition keeps the scripts' figures comparable.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: Prefix of the lines a benchmark worker prints for the launcher to collect.
RESULT = "RESULT "


def timed(totals: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding the seconds each call takes to ``totals[key]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


class CommTimed:
    """A transport's point-to-point ops (:mod:`graph_exec.transport.p2p`) with the calls ``names``
    timed into ``totals[name]``, so that a script can tell the time spent in MindSpore's
    communication from the Python around it."""

    def __init__(self, ops: Any, totals: dict[str, float], names: Sequence[str]) -> None:
        self._ops = ops
        for name in names:
            setattr(self, name, timed(totals, name, getattr(ops, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def argument_parser(module_doc: str | None, prog: str) -> argparse.ArgumentParser:
    """The parser of a benchmark script: ``--help`` prints its docstring, and bad arguments
    fail at once, before it launches any rank."""
    return argparse.ArgumentParser(
        prog=f"python -m graph_exec.benchmarks.{prog}",
        description=module_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def p10_p50_p90(values: Sequence[float]) -> tuple[float, float, float]:
    """The 10th, 50th and 90th percentiles (inclusive interpolation); one value is all three."""
    if len(values) < 2:
        return (values[0],) * 3
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], statistics.median(values), deciles[-1]


def launch_and_report(
    script: str | Path,
    args: Sequence[str],
    *,
    nproc: int,
    timeout_s: float,
    heading: str,
    ranks: Sequence[int] | None = None,
    sink: Callable[[str], None] = print,
) -> int:
    """Run ``script`` under msrun on ``nproc`` local ranks, then print ``heading`` and hand the
    ``RESULT`` lines of ``ranks`` (default: every rank), without their prefix, to ``sink``
    (default: print them); on failure print msrun's report to stderr. Returns the process exit
    status."""
    from graph_exec.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        result = launch(script, list(args), nproc=nproc, log_dir=Path(tmp) / "logs", timeout_s=timeout_s)
        if not result.ok:
            print(result.describe(), file=sys.stderr)
            return 1
        print(heading)
        for rank in sorted(result.worker_logs) if ranks is None else ranks:
            for line in result.worker_logs[rank].splitlines():
                if line.startswith(RESULT):
                    sink(line[len(RESULT) :])
    return 0
