"""The schedule layer: what every pipeline rank runs, and in which order.

Pure Python, never imports MindSpore. ``build_plan(PlanConfig(...))`` builds the body
(interleaved 1F1B, plain 1F1B, GPipe or the zero-bubble split backward: :mod:`.body`), inserts its P2P transfers (:mod:`.p2p`),
layers the MPipe Transpose steps on top (:mod:`.mpipe`) and checks the result
(:mod:`.validate`). Validation, the simulator and the tower placement replay a plan through
one walk (:mod:`.walk`), priced by one cost rule (:mod:`.costs`). The rules are written down
in ``docs/schedule.md``; each module cites its section. This layer has its own short names (``micro``, ``num_preprocess_layers``); how
they map to the public API's is in ``docs/schedule.md``, "Notation and names".
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
from graph_exec.schedule.size import PlanTooLargeError, check_plan_size, estimate_steps
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
    "PlanTooLargeError",
    "ScheduleError",
    "Step",
    "StepKind",
    "buffer_lifetimes",
    "build_plan",
    "check_plan_size",
    "estimate_steps",
    "to_csv",
    "to_json",
    "to_text",
    "validate",
    "write_json",
]
