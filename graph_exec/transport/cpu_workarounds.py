"""Work-arounds for MindSpore 2.10 communication traps, kept in one place.

``mindspore.mint.distributed`` binds ``"hccl_world_group"`` as the default group of its
rank/size cache helpers when it is imported. On the CPU backend that group does not exist,
so ``send``/``isend`` raise — and the peer then consumes the *next* message instead, silently
corrupting the order. Rebinding the defaults to the real world group after ``init()`` fixes
it; on Ascend the world group *is* ``hccl_world_group`` and the patch changes nothing.
"""

from __future__ import annotations


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
