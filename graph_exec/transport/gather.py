"""Job-wide exchange of small Python objects, with a deadline.

Used where every rank must learn every other rank's outcome before going on — checkpoint
saving and loading: each rank contributes "done, checksum ..." or "failed: why", so that a
failure on one rank is raised on all of them instead of leaving the others waiting. Runs on
its own :class:`CommWorker`, so a peer that died makes the call raise after ``timeout_s``.
"""

from __future__ import annotations

from typing import Any

from graph_exec.transport.comm import CommWorker, require_initialized
from graph_exec.transport.cpu_workarounds import rebind_default_groups

_worker: CommWorker | None = None


def world_size() -> int:
    """The number of processes in the job (1 without communication)."""
    from graph_exec.transport.comm import is_initialized

    if not is_initialized():
        return 1
    from mindspore.communication import get_group_size

    return int(get_group_size())


def all_gather_object(obj: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (picklable objects; keep them small).

    Raises :class:`~graph_exec.errors.PeerTimeoutError` naming ``what`` if some rank does not
    take part within ``timeout_s``; communication through this path is unusable afterwards.
    """
    global _worker
    require_initialized()
    import mindspore.mint.distributed as dist
    from mindspore.communication import GlobalComm

    rebind_default_groups()
    if _worker is None:
        _worker = CommWorker("graph_exec-gather")

    def gather() -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=GlobalComm.WORLD_COMM_GROUP)
        return out

    return _worker.run(gather, timeout_s, what)
