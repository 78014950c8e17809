"""The per-rank record a worker writes for one run, and reading a run directory back.

Times are seconds on ``time.perf_counter()``, which on Linux is the system-wide monotonic
clock: records written by different ranks of one machine share it, so their timelines can be
merged without any clock exchange. File: ``<run name>.rank<r>.json`` in the run directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    """One plan step as it ran on a rank (absolute times)."""

    token: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StepRecord:
    """One training step (one ``run()`` call) on one rank.

    ``start``/``end`` bracket the ``run()`` call; ``loss`` is the mean of the per-micro losses
    (last-stage rank only); the counters are cumulative since the schedule was built.
    """

    step: int
    start: float
    end: float
    events: tuple[Event, ...]
    loss: float | None
    compilations: int
    compile_seconds: float
    allocations: int


@dataclass(frozen=True)
class RankRecord:
    """Everything one rank measured for one run.

    ``activation_bytes``/``preprocess_bytes``: size of one body transfer and of one preprocess
    output transfer (0 where the run has none), for the simulator's bandwidth term.
    ``dispatch_seconds``: the executor's measured per-call cost outside the kernel (``None``
    unless the job asked for calibration, or where this rank had no chunk to calibrate on).
    ``memory``: the schedule's ``stats()["memory"]`` after the last step (``None`` in records
    written before it was recorded).
    """

    run: str
    rank: int
    ranks: int
    steps: tuple[StepRecord, ...]
    activation_bytes: int = 0
    preprocess_bytes: int = 0
    dispatch_seconds: float | None = None
    memory: dict | None = None  #: ``stats()["memory"]`` after the run's last step

    def path(self, run_dir: Path) -> Path:
        return record_path(run_dir, self.run, self.rank)

    def write(self, run_dir: Path) -> None:
        self.path(run_dir).write_text(json.dumps(asdict(self)), encoding="utf-8")

    @classmethod
    def from_dict(cls, data: dict) -> RankRecord:
        steps = tuple(
            StepRecord(**{**step, "events": tuple(Event(**event) for event in step["events"])})
            for step in data["steps"]
        )
        return cls(**{**data, "steps": steps})


def record_path(run_dir: Path, run: str, rank: int) -> Path:
    return Path(run_dir) / f"{run}.rank{rank}.json"


def read_run(run_dir: Path, run: str, ranks: int) -> list[RankRecord]:
    """Every rank's record of ``run``; a missing file raises ``FileNotFoundError`` naming it."""
    records = []
    for rank in range(ranks):
        path = record_path(run_dir, run, rank)
        if not path.exists():
            raise FileNotFoundError(f"rank {rank} wrote no record for run {run!r} ({path})")
        records.append(RankRecord.from_dict(json.loads(path.read_text(encoding="utf-8"))))
    return records
