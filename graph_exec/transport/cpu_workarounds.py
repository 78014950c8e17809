"""MindSpore 2.10 communication traps and backend facts the transport relies on, in one place.

``mindspore.mint.distributed`` binds ``"hccl_world_group"`` as the default group of its
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


def backend_ends_waits(timeout_s: float) -> bool:
    """Whether the back end itself fails a call that waits longer than ``timeout_s`` (rounded
    up to whole seconds), so that the call needs no deadline thread.

    True on CPU once :func:`bound_backend_waits` (or the user) set a limit no longer than that;
    measured with MindSpore 2.10: a receive from a silent peer, a send to a dead one, an
    all-reduce and a broadcast missing a rank all raise ``RuntimeError`` at the limit. Elsewhere
    the limit is not known to hold.
    """
    import mindspore as ms

    return ms.get_context("device_target") == "CPU" and backend_wait_limit() <= math.ceil(timeout_s)


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


def world_barrier(dist: Any, group: str) -> None:
    """Block until every rank of ``group`` gets here, without the CPU ``[ERROR]`` line.

    ``mint.distributed.barrier`` ends with ``mindspore.runtime.synchronize()``, a stream call
    that on CPU does nothing but log "CPU device is not supported" (as ``[ERROR]``, on every
    rank of every successful run). On CPU a blocking all-reduce of one element is the same
    rendezvous (no rank can finish it before all have started it) and ``asnumpy()`` waits for
    it; elsewhere MindSpore's own barrier is used.
    """
    import mindspore as ms

    if ms.get_context("device_target") != "CPU":
        dist.barrier(group=group)
        return
    token = ms.Tensor(np.zeros(1, dtype=np.int32))
    dist.all_reduce(token, group=group)
    token.asnumpy()


def sends_complete_on_post() -> bool:
    """Whether an ``isend`` has taken its data by the time it returns, so its buffer is free.

    True on the CPU backend (MCCL): measured with MindSpore 2.10, a 1 KiB and a 1 MiB ``isend``
    overwritten right after the call still arrived intact while the receiver slept, a 4 MiB one
    returned only once the data was handed over, and the handle's ``wait()`` returned at once.
    The transport then waits each send right away, in the caller, and reuses its staging memory,
    instead of keeping handles for a drain on the communication thread. Elsewhere sends really
    are asynchronous and are drained with a deadline.
    """
    import mindspore as ms

    return ms.get_context("device_target") == "CPU"


def tensors_in_host_memory() -> bool:
    """Whether ``Tensor.data_ptr()`` is a host address that this process can copy from.

    True on CPU: measured with MindSpore 2.10, ``data_ptr()`` first waits for the op that makes
    the tensor (like ``asnumpy``) and already includes a view's storage offset. It costs about
    0.3 µs against ``asnumpy``'s 4.6 µs (most of it numpy parsing the buffer's format string),
    which is a large share of a small transfer. Elsewhere it is a device address.
    """
    import mindspore as ms

    return ms.get_context("device_target") == "CPU"
