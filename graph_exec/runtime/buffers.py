"""Receive buffers from the pool, handed back at the step that last reads them.

The plan says, for every receive, which later step is the last to read what arrived (a stage
input is read again by the stage's backward, which recomputes the forward from it). A buffer
is taken from the pool when the receive happens and given back right after that step, so
from the second training step on (same shapes) every receive reuses memory: no allocation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from graph_exec.bufpool import Block, BufferPool


class ReceiveBuffers:
    """Hands out pool-backed receive tensors for one rank's plan and reclaims them on time."""

    def __init__(self, pool: BufferPool, last_use: Sequence[tuple[int, int]]) -> None:
        """``last_use``: ``(receive step index, index of the last step reading it)`` pairs."""
        self.pool = pool
        self._release_after: dict[int, list[int]] = defaultdict(list)
        for recv_index, last_index in last_use:
            self._release_after[last_index].append(recv_index)
        self._held: dict[int, list[Block]] = defaultdict(list)

    def allocator(self, recv_index: int) -> Callable[[int], np.ndarray]:
        """The allocator for the receive at ``recv_index`` (message memory for the transport,
        see :data:`graph_exec.transport.comm.Allocator`): its blocks are tracked under it."""

        def allocate(nbytes: int) -> np.ndarray:
            block = self.pool.acquire(nbytes)
            self._held[recv_index].append(block)
            return block.view(np.uint8, (nbytes,))

        return allocate

    def due(self, step_index: int) -> bool:
        """Whether some held buffer is last read by ``step_index``."""
        return any(self._held.get(i) for i in self._release_after.get(step_index, ()))

    def release_after(self, step_index: int) -> None:
        """Give back every buffer whose last reader was ``step_index``."""
        for recv_index in self._release_after.get(step_index, ()):
            for block in self._held.pop(recv_index, ()):
                self.pool.release(block)

    def release_all(self) -> None:
        """Give back everything (end of an aborted step)."""
        for blocks in self._held.values():
            for block in blocks:
                self.pool.release(block)
        self._held.clear()

    @property
    def held(self) -> int:
        """How many blocks are out right now."""
        return sum(len(blocks) for blocks in self._held.values())
