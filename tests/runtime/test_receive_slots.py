"""Receive slots on the device path: MindSpore tensors made once per slot, reused by exact size,
and written again only after the fence their last readers left has passed."""

from __future__ import annotations

from typing import ClassVar

import mindspore as ms
import numpy as np
import pytest

from graph_exec.runtime import buffers
from graph_exec.runtime.buffers import DeviceSlots, HostBlocks, ReceiveBuffers, receive_slots


class RecordedFence:
    """A fence that records when it is made and waited for."""

    log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.number = len([entry for entry in RecordedFence.log if entry.startswith("made")])
        RecordedFence.log.append(f"made {self.number}")

    def wait(self) -> None:
        RecordedFence.log.append(f"waited {self.number}")


@pytest.fixture
def fences(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    RecordedFence.log = []
    monkeypatch.setattr(buffers, "Fence", RecordedFence)
    return RecordedFence.log


def test_a_slot_is_reused_by_exact_size_after_its_fence(fences: list[str]) -> None:
    slots = DeviceSlots()
    first, memory = slots.acquire(1024)
    assert memory.dtype == ms.uint8 and memory.shape == (1024,)
    slots.release(first)
    assert fences == ["made 0"]
    other, _ = slots.acquire(2048)  # another size: a new slot, no wait
    assert other is not first and fences == ["made 0"]
    again, reused = slots.acquire(1024)
    assert again is first and reused is memory
    assert fences == ["made 0", "waited 0"]
    stats = slots.stats()
    assert (stats.allocations, stats.reuses, stats.live_blocks, stats.live_bytes) == (2, 1, 2, 3072)
    assert stats.reserved_bytes == 3072 and stats.peak_bytes == 3072


def test_steady_state_receives_allocate_nothing(fences: list[str]) -> None:
    """A plan's receives of one step, replayed: from the second step on every slot is reused."""
    receive_buffers = ReceiveBuffers(DeviceSlots(), [(0, 2), (1, 3), (4, 5)])
    sizes = {0: 1024, 1: 1024, 4: 4096}
    allocations = []
    for _ in range(3):
        for step in range(6):
            if step in sizes:
                receive_buffers.allocator(step)(sizes[step])
            if receive_buffers.due(step):
                receive_buffers.release_after(step)
        assert receive_buffers.held == 0
        allocations.append(receive_buffers.slots.stats().allocations)
    assert allocations == [3, 3, 3]
    assert fences.count("made 0") == 1 and len([f for f in fences if f.startswith("waited")]) == 6


def test_the_fence_waits_for_reads_dispatched_before_the_release() -> None:
    """The real fence: a value computed from a slot before its release is unchanged by the next
    message written into the slot (with synchronous dispatch the fence is free; the order holds
    either way)."""
    slots = DeviceSlots()
    slot, memory = slots.acquire(8)
    memory.assign_value(ms.Tensor(np.arange(8, dtype=np.uint8)))
    read = memory.view(ms.int32) + 0
    slots.release(slot)
    _, again = slots.acquire(8)
    again.assign_value(ms.Tensor(np.zeros(8, np.uint8)))
    assert read.asnumpy().tolist() == np.arange(8, dtype=np.uint8).view(np.int32).tolist()


def test_the_policy_chooses_the_realisation(cpu_path) -> None:
    chosen = receive_slots()
    assert isinstance(chosen, HostBlocks if cpu_path.host_memory_aliasing else DeviceSlots)


def test_idle_slots_past_the_bound_are_freed_oldest_first_after_their_fence(fences: list[str]) -> None:
    slots = DeviceSlots(cache_bytes=3000)
    a, _ = slots.acquire(1024)
    b, _ = slots.acquire(2048)
    c, _ = slots.acquire(1024)
    slots.release(a)
    slots.release(b)  # 3072 idle > 3000: a, released first, goes once its fence passed
    assert fences == ["made 0", "made 1", "waited 0"] and a.tensor is None and b.tensor is not None
    slots.release(c)  # b is now the oldest idle slot
    assert fences[3:] == ["made 2", "waited 1"] and b.tensor is None
    again, _ = slots.acquire(1024)
    assert again is c and fences[5:] == ["waited 2"]
    stats = slots.stats()
    assert (stats.allocations, stats.reuses, stats.reserved_bytes, stats.free_blocks) == (3, 1, 1024, 0)
    assert slots.cache_stats() == {
        "entries": 0,
        "bytes": 0,
        "max_bytes": 3000,
        "evictions": 2,
        "evicted_bytes": 3072,
    }


def test_a_slot_in_use_is_never_freed_by_the_bound(fences: list[str]) -> None:
    """Only released slots count against the bound: one still out (a receive in flight, or a
    step that reads it) keeps its tensor however many others come and go."""
    slots = DeviceSlots(cache_bytes=0)
    out, memory = slots.acquire(64)
    for size in (128, 256, 512):
        slot, _ = slots.acquire(size)
        slots.release(slot)
        assert slot.tensor is None
    assert out.tensor is memory and slots.stats().live_bytes == 64
    assert slots.cache_stats()["evictions"] == 3 and slots.stats().reserved_bytes == 64


def test_an_evicted_slot_leaves_values_read_before_its_release_intact() -> None:
    """The real fence, bound 0: the slot is freed at its release, after the ops that read it; a
    new slot of the same size is a fresh tensor and its message does not reach the old value."""
    slots = DeviceSlots(cache_bytes=0)
    slot, memory = slots.acquire(8)
    memory.assign_value(ms.Tensor(np.arange(8, dtype=np.uint8)))
    read = memory.view(ms.int32) + 0
    slots.release(slot)
    fresh, again = slots.acquire(8)
    assert fresh is not slot and slots.stats().allocations == 2
    again.assign_value(ms.Tensor(np.zeros(8, np.uint8)))
    assert read.asnumpy().tolist() == np.arange(8, dtype=np.uint8).view(np.int32).tolist()


def test_host_blocks_free_every_idle_block_past_the_bound() -> None:
    """The host pool's size classes: 3000 and 2900 bytes share the 3072-byte class, so they reuse
    one block; past the bound every idle block goes (the C++ pool keeps no use order)."""
    blocks = HostBlocks(cache_bytes=6000)
    first, _ = blocks.acquire(3000)
    blocks.release(first)
    second, _ = blocks.acquire(2900)  # same size class: the idle block is reused
    assert blocks.stats().reuses == 1
    third, _ = blocks.acquire(5000)
    blocks.release(second)
    assert blocks.cache_stats()["entries"] == 1  # 3072 idle <= 6000
    blocks.release(third)  # 3072 + 5120 idle > 6000: both freed
    assert blocks.cache_stats() == {
        "entries": 0,
        "bytes": 0,
        "max_bytes": 6000,
        "evictions": 2,
        "evicted_bytes": 3072 + 5120,
    }
    assert blocks.stats().reserved_bytes == 0


def test_the_policy_passes_the_bound_on(cpu_path) -> None:
    assert receive_slots(12345).cache_stats()["max_bytes"] == 12345
