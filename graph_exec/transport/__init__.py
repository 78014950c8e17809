"""Transport: the only layer that talks to ``mindspore.communication``."""

from graph_exec.transport.comm import (
    LAUNCH_HINT,
    Transport,
    TransportStats,
    barrier,
    is_initialized,
    numpy_allocator,
    pipeline_rank,
    require_initialized,
)
from graph_exec.transport.meta import TensorMeta

__all__ = [
    "LAUNCH_HINT",
    "TensorMeta",
    "Transport",
    "TransportStats",
    "barrier",
    "is_initialized",
    "numpy_allocator",
    "pipeline_rank",
    "require_initialized",
]
