"""Receive buffers, reused from step to step and handed back at the step that last reads them.

The plan says, for every receive, which later step is the last to read what arrived (a stage
input is read again by the stage's backward). A buffer is taken when the receive happens and
given back right after that step, so from the second training step on (same shapes) every
receive reuses memory: no allocation.

A buffer is a *slot*, realised in one of two ways (chosen by the device policy's
:attr:`~graph_exec.device.DevicePolicy.host_memory_aliasing`, the same choice as the transport's
frames):

- :class:`HostBlocks` (CPU fast path): blocks of the C++ size-class pool (:mod:`graph_exec.bufpool`),
  viewed as uint8 numpy arrays; MindSpore receives straight into them.
- :class:`DeviceSlots` (every device, and CPU with the fast paths off): uint8 MindSpore tensors,
  one per slot, made once and reused. A slot holds exactly the bytes of its message (NCCL and HCCL
  match a receive by its byte count, so a message cannot land in a larger size-class block), and
  asynchronous dispatch means the ops that read a slot may not have run when the step that
  dispatched them ends: a slot given back carries a :class:`~graph_exec.device.Fence`, and is
  written again only after the fence has passed.

Bounds: when shapes change from step to step each new size leaves idle memory behind, so both
keep at most ``cache_bytes`` idle (``buffer_cache_bytes`` of the schedule; a slot that is out is
never counted against it nor freed). :class:`DeviceSlots` keeps its idle slots in an
:class:`~graph_exec.idle_buffers.IdleBuffers`: the least recently released goes first, and only
after its fence has passed, so no op dispatched before its release still reads freed memory.
:class:`HostBlocks` rounds sizes up to the pool's size classes (four per power of two), so few
classes serve many sizes; past the bound it frees every idle block at once
(:meth:`~graph_exec.bufpool.BufferPool.trim`; the C++ pool keeps no use order to evict by).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from graph_exec import checks
from graph_exec.bufpool import BufferPool, PoolStats
from graph_exec.device import Fence
from graph_exec.idle_buffers import DEFAULT_BUFFER_CACHE_BYTES, IdleBuffers


class Slots(Protocol):
    """Memory for receives: ``acquire`` a slot of ``nbytes`` and its frame memory, ``release`` it."""

    def acquire(self, nbytes: int) -> tuple[Any, Any]:
        """``(slot, frame memory of exactly nbytes)``; the memory is what the transport's frames use."""

    def release(self, slot: Any) -> None:
        """Give ``slot`` back once every step that reads it has been dispatched."""

    def stats(self) -> PoolStats:
        """Counters (the pool's; ``allocations`` stops growing in steady state)."""

    def cache_stats(self) -> dict[str, Any]:
        """The idle memory kept for reuse and its bound (``IdleBuffers.stats``' keys)."""


class HostBlocks:
    """Slots realised as blocks of the C++ buffer pool (host memory, the CPU fast path), with at
    most ``cache_bytes`` of idle blocks (past it, every idle block is freed).

    The idle bytes are followed here, per size class, rather than read from the pool's counters
    after every release (a snapshot of them costs several times an acquire and release).
    """

    def __init__(self, pool: BufferPool | None = None, cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES) -> None:
        self.pool = pool or BufferPool()
        self.cache_bytes = checks.non_negative_int("buffer_cache_bytes", cache_bytes)
        self._idle: dict[int, int] = {}  # size class -> idle blocks of it in the pool
        self._idle_bytes = 0
        self._trims = [0, 0]  # blocks and bytes freed by the bound

    def acquire(self, nbytes: int) -> tuple[Any, np.ndarray]:
        block = self.pool.acquire(nbytes)
        idle = self._idle.get(block.capacity, 0)
        if idle:  # the pool reused an idle block of its class
            self._idle[block.capacity] = idle - 1
            self._idle_bytes -= block.capacity
        return block, block.view(np.uint8, (nbytes,))

    def release(self, slot: Any) -> None:
        self.pool.release(slot)
        self._idle[slot.capacity] = self._idle.get(slot.capacity, 0) + 1
        self._idle_bytes += slot.capacity
        if self._idle_bytes > self.cache_bytes:
            self._trims[0] += sum(self._idle.values())
            self._trims[1] += self.pool.trim()
            self._idle.clear()
            self._idle_bytes = 0

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def cache_stats(self) -> dict[str, Any]:
        stats = self.pool.stats()
        return {
            "entries": stats.free_blocks,
            "bytes": stats.reserved_bytes - stats.live_bytes,
            "max_bytes": self.cache_bytes,
            "evictions": self._trims[0],
            "evicted_bytes": self._trims[1],
        }


class _DeviceSlot:
    """One reusable uint8 tensor and the fence its last readers left on it."""

    __slots__ = ("fence", "nbytes", "tensor")

    def __init__(self, tensor: Any, nbytes: int) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.fence: Fence | None = None


class DeviceSlots:
    """Slots realised as MindSpore tensors, one per slot, reused by exact size.

    ``allocate(nbytes)`` makes a slot's tensor (default: ``ops.zeros`` of uint8). A released
    slot is kept idle under its size with a fence; :meth:`acquire` reuses the most recently
    released one of the size asked for, after waiting for its fence, or makes a new one. At most
    ``cache_bytes`` of idle slots are kept: past it the least recently released is freed once its
    fence has passed. The counters follow :class:`~graph_exec.bufpool.PoolStats` (capacities are
    exact sizes here).
    """

    def __init__(
        self, allocate: Callable[[int], Any] | None = None, cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES
    ) -> None:
        if allocate is None:
            from graph_exec.transport.frame_memory import tensor_allocator as allocate
        self._allocate = allocate
        self._idle: IdleBuffers[_DeviceSlot] = IdleBuffers(cache_bytes, self._free_slot)
        self._counts = dict.fromkeys(
            ("acquires", "allocations", "reuses", "releases", "live_blocks", "live_bytes", "peak_bytes"), 0
        )
        self._reserved = 0

    def acquire(self, nbytes: int) -> tuple[_DeviceSlot, Any]:
        slot = self._idle.take(nbytes)
        if slot is not None:
            slot.fence.wait()  # the ops that read its previous message have run
            slot.fence = None
            self._counts["reuses"] += 1
        else:
            slot = _DeviceSlot(self._allocate(nbytes), nbytes)
            self._counts["allocations"] += 1
            self._reserved += nbytes
        counts = self._counts
        counts["acquires"] += 1
        counts["live_blocks"] += 1
        counts["live_bytes"] += nbytes
        counts["peak_bytes"] = max(counts["peak_bytes"], counts["live_bytes"])
        return slot, slot.tensor

    def release(self, slot: _DeviceSlot) -> None:
        slot.fence = Fence()  # after every op dispatched so far, the slot's last readers among them
        self._counts["releases"] += 1
        self._counts["live_blocks"] -= 1
        self._counts["live_bytes"] -= slot.nbytes
        self._idle.give(slot.nbytes, slot, slot.nbytes)

    def _free_slot(self, slot: _DeviceSlot) -> None:
        """Let go of an evicted idle slot once the ops that read its last message have run."""
        slot.fence.wait()
        slot.tensor = None
        self._reserved -= slot.nbytes

    def stats(self) -> PoolStats:
        return PoolStats(
            **self._counts,
            auto_releases=0,
            reserved_bytes=self._reserved,
            free_blocks=len(self._idle),
        )

    def cache_stats(self) -> dict[str, Any]:
        return self._idle.stats()


class ReceiveBuffers:
    """Hands out receive memory for one rank's plan and reclaims it on time."""

    def __init__(self, slots: Slots, last_use: Sequence[tuple[int, int]]) -> None:
        """``last_use``: ``(receive step index, index of the last step reading it)`` pairs."""
        self.slots = slots
        self._release_after: dict[int, list[int]] = defaultdict(list)
        for recv_index, last_index in last_use:
            self._release_after[last_index].append(recv_index)
        self._held: dict[int, list[tuple[Any, int]]] = defaultdict(list)
        #: Bytes of the messages whose buffers are out now (the memory accounting reads it).
        self.held_bytes = 0

    def allocator(self, recv_index: int) -> Callable[[int], Any]:
        """The allocator for the receive at ``recv_index`` (message memory for the transport,
        see :data:`graph_exec.transport.frame_memory.Allocator`): its slots are tracked under it."""

        def allocate(nbytes: int) -> Any:
            slot, memory = self.slots.acquire(nbytes)
            self._held[recv_index].append((slot, nbytes))
            self.held_bytes += nbytes
            return memory

        return allocate

    def due(self, step_index: int) -> bool:
        """Whether some held buffer is last read by ``step_index``."""
        return any(self._held.get(i) for i in self._release_after.get(step_index, ()))

    def release_after(self, step_index: int) -> None:
        """Give back every buffer whose last reader was ``step_index``."""
        for recv_index in self._release_after.get(step_index, ()):
            for slot, nbytes in self._held.pop(recv_index, ()):
                self.slots.release(slot)
                self.held_bytes -= nbytes

    def release_all(self) -> None:
        """Give back everything (end of an aborted step)."""
        for held in self._held.values():
            for slot, _ in held:
                self.slots.release(slot)
        self._held.clear()
        self.held_bytes = 0

    @property
    def held(self) -> int:
        """How many slots are out right now."""
        return sum(len(held) for held in self._held.values())


def receive_slots(cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES) -> Slots:
    """The slots this process's receives use, as the device policy decides, keeping at most
    ``cache_bytes`` of idle memory."""
    from graph_exec.device import policy

    if policy().host_memory_aliasing:
        return HostBlocks(cache_bytes=cache_bytes)
    return DeviceSlots(cache_bytes=cache_bytes)
