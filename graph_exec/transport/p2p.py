"""Point-to-point messages between the ranks of one group, with the per-call lookups done once.

``mindspore.mint.distributed.isend``/``recv`` check their arguments, look the peer's group rank
up in a cache and wrap the result in a Python handle on every call, then call MindSpore's own
send and receive ops (``dist_comm_isend_op``/``dist_comm_irecv_op``). A transport calls them
with the same group and peers for its whole life, so :class:`DirectPointToPoint` resolves the
peers' group ranks once and calls those ops itself. Measured with MindSpore 2.10 on a 2-core
machine: a bare 1 KiB ping-pong through the ops takes 6–9 % less time than through the public
functions (``python -m graph_exec.benchmarks.transport_speed`` prints both). It also sidesteps
the public functions' import-time default group (see
:func:`~graph_exec.transport.cpu_workarounds.rebind_default_groups`), since the group is always
named. Where the ops are not importable under these names, or the group ranks cannot be
resolved, :class:`PublicPointToPoint` calls the public functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PointToPoint(Protocol):
    """Send and receive one tensor to or from ``peer``, a rank *of the group* (not a world rank)."""

    def isend(self, tensor: Any, peer: int) -> Any:
        """Post ``tensor`` to ``peer``; the result's ``wait()`` returns once it has left."""

    def recv(self, tensor: Any, peer: int) -> None:
        """Receive ``peer``'s next message into ``tensor`` (blocking)."""


class _NoWait:
    """The handle of a send that MindSpore completed without one."""

    @staticmethod
    def wait() -> None:
        return None


NO_WAIT = _NoWait()


class PublicPointToPoint:
    """Through ``mindspore.mint.distributed`` (which takes world ranks)."""

    def __init__(self, dist: Any, group: str, world_ranks: Sequence[int]) -> None:
        self._dist = dist
        self._group = group
        self._world_ranks = tuple(world_ranks)

    def isend(self, tensor: Any, peer: int) -> Any:
        return self._dist.isend(tensor, dst=self._world_ranks[peer], group=self._group)

    def recv(self, tensor: Any, peer: int) -> None:
        self._dist.recv(tensor, src=self._world_ranks[peer], group=self._group)


class DirectPointToPoint:
    """Through MindSpore's send and receive ops, with each peer's group rank resolved once."""

    def __init__(self, send_op: Any, recv_op: Any, group: str, group_ranks: Sequence[int]) -> None:
        self._send_op = send_op
        self._recv_op = recv_op
        self._group = group
        self._group_ranks = tuple(group_ranks)

    def isend(self, tensor: Any, peer: int) -> Any:
        output = self._send_op(tensor, self._group_ranks[peer], self._group, 0)
        return output[1] if isinstance(output, tuple) else NO_WAIT

    def recv(self, tensor: Any, peer: int) -> None:
        output = self._recv_op(tensor, 0, self._group_ranks[peer], self._group)
        if isinstance(output, tuple):
            output[1].wait()


def point_to_point(dist: Any, group: str, world_ranks: Sequence[int]) -> PointToPoint:
    """The fastest available way to message the ranks ``world_ranks`` of ``group``."""
    try:
        from mindspore.communication import get_group_rank_from_world_rank
        from mindspore.ops.auto_generate.gen_ops_prim import dist_comm_irecv_op, dist_comm_isend_op

        group_ranks = [int(get_group_rank_from_world_rank(rank, group)) for rank in world_ranks]
    except (ImportError, RuntimeError, ValueError, TypeError):
        return PublicPointToPoint(dist, group, world_ranks)
    return DirectPointToPoint(dist_comm_isend_op, dist_comm_irecv_op, group, group_ranks)
