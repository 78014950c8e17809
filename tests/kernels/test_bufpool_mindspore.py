"""Pool blocks become MindSpore tensors without a copy (``mindspore.from_numpy`` of a block view)."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("GLOG_v", "3")  # read when MindSpore loads: keeps its logs quiet

import mindspore as ms
import numpy as np
import pytest

from graph_exec.bufpool import BufferPool
from graph_exec.msenv import prepare_mindspore


@pytest.fixture(scope="module", autouse=True)
def _cpu():
    prepare_mindspore("CPU")


def test_numpy_writes_are_seen_by_the_tensor():
    pool = BufferPool()
    block = pool.acquire(4 * 32)
    view = block.view(np.float32, (4, 8))
    tensor = ms.from_numpy(view)
    assert tensor.data_ptr() == block.address
    view[:] = 3.0
    assert np.array_equal(tensor.asnumpy(), np.full((4, 8), 3.0, np.float32))
    assert np.array_equal((tensor * 2).asnumpy(), np.full((4, 8), 6.0, np.float32))
    np.asarray(block)[:4] = np.frombuffer(np.float32(-1.0).tobytes(), np.uint8)  # buffer protocol
    assert tensor.asnumpy()[0, 0] == -1.0


def test_mindspore_writes_land_in_the_block():
    pool = BufferPool()
    block = pool.acquire(4 * 16)
    view = block.view(np.float32, 16)
    view[:] = 0.0
    tensor = ms.from_numpy(view)
    tensor.copy_(ms.Tensor(np.arange(16, dtype=np.float32)))
    assert np.array_equal(view, np.arange(16, dtype=np.float32))
    ms.ops.assign_add(tensor, ms.Tensor(np.ones(16, np.float32)))
    assert np.array_equal(np.frombuffer(block, np.float32), np.arange(1, 17, dtype=np.float32))
    tensor.asnumpy()[0] = 42.0  # asnumpy() is a view of the same memory
    assert view[0] == 42.0


def test_a_jitted_function_reads_the_live_block_memory():
    @ms.jit
    def affine(x):
        return x * 2 + 1

    pool = BufferPool()
    block = pool.acquire(4 * 64)
    view = block.view(np.float32, (8, 8))
    tensor = ms.from_numpy(view)
    view[:] = 1.0
    assert np.array_equal(affine(tensor).asnumpy(), np.full((8, 8), 3.0, np.float32))
    view[:] = np.arange(64, dtype=np.float32).reshape(8, 8)  # same tensor object, new contents
    assert np.array_equal(affine(tensor).asnumpy(), np.arange(64, dtype=np.float32).reshape(8, 8) * 2 + 1)


def test_receive_loop_reuses_one_block():
    """The runtime's pattern: acquire, wrap as a tensor, compute, release, once per micro-batch."""
    pool = BufferPool()
    addresses = set()
    for step in range(5):
        block = pool.acquire(4 * 100)
        view = block.view(np.float32, 100)
        view[:] = step
        tensor = ms.from_numpy(view)
        assert float(tensor.sum().asnumpy()) == 100.0 * step
        addresses.add(tensor.data_ptr())
        del tensor, view
        pool.release(block)
    stats = pool.stats()
    assert len(addresses) == 1 and (stats.allocations, stats.reuses) == (1, 4)


def test_a_tensor_keeps_its_memory_after_release_and_trim():
    pool = BufferPool()
    block = pool.acquire(1 << 16)
    view = block.view(np.float32, (1 << 16) // 4)
    view[:] = 7.0
    tensor = ms.from_numpy(view)
    pool.release(block)
    del block, view
    gc.collect()
    assert pool.trim() == 1 << 16
    fresh = [pool.acquire(1 << 16) for _ in range(4)]
    for other in fresh:
        np.asarray(other)[:] = 0xFF
    assert np.all(tensor.asnumpy() == 7.0)
    assert float((tensor + 1).sum().asnumpy()) == 8.0 * ((1 << 16) // 4)
