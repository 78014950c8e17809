"""Transport: the only layer that talks to ``mindspore.communication``."""

from graph_exec.transport.comm import (
    LAUNCH_HINT,
    Transport,
    TransportStats,
    all_gather_objects,
    barrier,
    is_initialized,
    pipeline_rank,
    require_initialized,
)
from graph_exec.transport.cpu_workarounds import backend_limit_is_process_wide, bound_backend_waits
from graph_exec.transport.host_sum import HostSum
from graph_exec.transport.mesh import CommGroup, DeviceMesh
from graph_exec.transport.meta import TensorMeta

__all__ = [
    "LAUNCH_HINT",
    "CommGroup",
    "DeviceMesh",
    "HostSum",
    "TensorMeta",
    "Transport",
    "TransportStats",
    "all_gather_objects",
    "backend_limit_is_process_wide",
    "barrier",
    "bound_backend_waits",
    "is_initialized",
    "pipeline_rank",
    "require_initialized",
]
