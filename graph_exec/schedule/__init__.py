"""The schedule layer: what every pipeline rank runs, and in which order.

Pure Python, never imports MindSpore. ``build_plan(PlanConfig(...))`` builds the body
(interleaved 1F1B, plain 1F1B or GPipe), inserts its P2P transfers, layers the MPipe Transpose
steps on top and validates the result against the contract in
``shared/design/mpipe-schedule.md``.
"""

from graph_exec.schedule.config import PlanConfig, PlanConfigError
from graph_exec.schedule.errors import (
    CoverageError,
    DeadlockError,
    DependencyError,
    FifoOrderError,
    InvariantError,
    PairingError,
    ScheduleError,
)
from graph_exec.schedule.export import to_csv, to_json, to_text, write_json
from graph_exec.schedule.lifetimes import BufferLifetime, buffer_lifetimes
from graph_exec.schedule.plan import Plan, build_plan
from graph_exec.schedule.steps import IDLE, Step, StepKind
from graph_exec.schedule.validate import validate

__all__ = [
    "IDLE",
    "BufferLifetime",
    "CoverageError",
    "DeadlockError",
    "DependencyError",
    "FifoOrderError",
    "InvariantError",
    "PairingError",
    "Plan",
    "PlanConfig",
    "PlanConfigError",
    "ScheduleError",
    "Step",
    "StepKind",
    "buffer_lifetimes",
    "build_plan",
    "to_csv",
    "to_json",
    "to_text",
    "validate",
    "write_json",
]
