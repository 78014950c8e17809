"""MindSpore 2.10 communication traps and back-end facts the transport relies on.

Which of them a process uses is decided by :mod:`graph_exec.device`; this module holds the
mechanisms. ``mindspore.mint.distributed`` binds ``"hccl_world_group"`` as the default group of its
rank/size cache helpers when it is imported. On the CPU backend that group does not exist,
so ``send``/``isend`` raise — and the peer then consumes the *next* message instead, silently
corrupting the order. Rebinding the defaults to the real world group after ``init()`` fixes
it; on Ascend the world group *is* ``hccl_world_group`` and the patch changes nothing.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from graph_exec.device import policy

#: MindSpore's CPU back end fails a send or receive that has not completed after this many
#: seconds (default 30, measured with 2.10). It reads the variable once, at the process's
#: first communication call (a change after that has no effect, also measured).
BACKEND_TIMEOUT_ENV = "MS_CPU_COMM_OP_TIMEOUT"
BACKEND_DEFAULT_TIMEOUT_S = 30.0


def bound_backend_waits(timeout_s: float) -> None:
    """Let MindSpore's CPU back end wait ``timeout_s`` (rounded up to whole seconds) before it
    fails a call, unless the user set ``MS_CPU_COMM_OP_TIMEOUT``; call before communicating.

    Without it a peer silent for more than 30 s (one compiling a large graph, say) failed every
    receive after 30 s whatever ``timeout_s`` asked for. With it the back end ends a wait when the
    transport's deadline does, so the transport's calls can run on the caller's thread
    (:func:`backend_ends_waits`). Only the first setting of a process counts, so the first caller
    wins: the schedules and the harness call this with their ``timeout_s`` before their first
    message.
    """
    os.environ.setdefault(BACKEND_TIMEOUT_ENV, str(math.ceil(timeout_s)))


def backend_wait_limit() -> float:
    """Seconds after which the back end fails a call, as far as this process can tell (the
    variable's value now; the default when unset or unreadable)."""
    try:
        return float(os.environ.get(BACKEND_TIMEOUT_ENV, BACKEND_DEFAULT_TIMEOUT_S))
    except ValueError:
        return BACKEND_DEFAULT_TIMEOUT_S


def backend_limit_is_process_wide() -> bool:
    """Whether one back-end wait limit holds for every call of the process: on CPU (either path)
    MindSpore reads ``MS_CPU_COMM_OP_TIMEOUT`` once, so a longer limit for some waits is a longer
    limit for all, and a call whose wait timed out on the communication thread stays in flight
    until it."""
    return policy().target == "CPU"


def backend_ends_waits(timeout_s: float) -> bool:
    """Whether the back end itself fails a call that waits longer than ``timeout_s`` (rounded
    up to whole seconds), so that the call needs no deadline thread.

    True where the device policy relies on it (:attr:`~graph_exec.device.DevicePolicy.backend_bounds_waits`:
    CPU with its fast paths on) once :func:`bound_backend_waits` (or the user) set a limit no
    longer than that; measured with MindSpore 2.10: a receive from a silent peer, a send to a
    dead one, an all-reduce and a broadcast missing a rank all raise ``RuntimeError`` at the
    limit. Elsewhere the limit is not known to hold.
    """
    return policy().backend_bounds_waits and backend_wait_limit() <= math.ceil(timeout_s)


def rebind_default_groups() -> None:
    """Point the import-time group defaults at the initialised world group."""
    import mindspore.mint.distributed.distributed as mint_dist
    import mindspore.ops.function.comm_func as comm_func
    from mindspore.communication import GlobalComm

    for module in (mint_dist, comm_func):
        for name in ("get_cache_group_rank", "get_cache_group_size"):
            helper = getattr(module, name, None)
            if helper is not None and helper.__defaults__:
                helper.__defaults__ = (GlobalComm.WORLD_COMM_GROUP,)


def world_barrier(dist: Any, group: str, host_barrier: bool | None = None) -> None:
    """Block until every rank of ``group`` gets here.

    With the policy's :attr:`~graph_exec.device.DevicePolicy.host_barrier` (``None``: ask it), a
    blocking all-reduce of one element: ``mint.distributed.barrier`` ends with
    ``mindspore.runtime.synchronize()``, which on CPU does nothing but log "CPU device is not
    supported" (as ``[ERROR]``, on every rank of every run), while no rank can finish the
    all-reduce before all have started it, and reading its result waits for it. Otherwise
    MindSpore's own barrier.
    """
    if not (policy().host_barrier if host_barrier is None else host_barrier):
        dist.barrier(group=group)
        return
    import mindspore as ms

    token = ms.Tensor(np.zeros(1, dtype=np.int32))
    dist.all_reduce(token, group=group)
    token.asnumpy()
