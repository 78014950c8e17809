"""graph_exec: pipeline-parallel training of MindSpore models with the MPipe Transpose schedule.

Importing the package is cheap: MindSpore is imported only by the parts that compute or
communicate, so planning and simulating work on a machine without MindSpore. The training
API (``PipelineStage``, ``ScheduleMPipeTranspose``, ``ScheduleInterleaved1F1B``,
``DeviceMesh``) and the checkpoint functions (``save_checkpoint``, ``load_checkpoint``,
``latest_checkpoint``) load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PipelineStage": "graph_exec.runtime.stage",
    "ScheduleMPipeTranspose": "graph_exec.runtime.schedules",
    "ScheduleInterleaved1F1B": "graph_exec.runtime.schedules",
    "DeviceMesh": "graph_exec.transport.mesh",
    "save_checkpoint": "graph_exec.checkpoint",
    "load_checkpoint": "graph_exec.checkpoint",
    "latest_checkpoint": "graph_exec.checkpoint",
}

__all__ = [
    "DeviceMesh",
    "PipelineStage",
    "ScheduleInterleaved1F1B",
    "ScheduleMPipeTranspose",
    "__version__",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graph_exec' has no attribute {name!r}")
