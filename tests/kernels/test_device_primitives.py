"""The target primitives of :mod:`graph_exec.device`: a fence is free with synchronous dispatch,
an event on a target with streams, a drain of MindSpore's op queue on CPU with asynchronous
dispatch; ``wait_for`` reads tensors on CPU and synchronises the streams elsewhere."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from graph_exec import device
from graph_exec.device import DevicePolicy, Fence


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every wait the primitives do instead of doing it."""
    log: list[str] = []

    class FakeEvent:
        def record(self) -> None:
            log.append("event recorded")

        def synchronize(self) -> None:
            log.append("event waited")

    monkeypatch.setattr(ms.runtime, "Event", FakeEvent)
    monkeypatch.setattr(ms.runtime, "synchronize", lambda: log.append("streams synchronised"))
    monkeypatch.setattr(device, "_drain_op_queue", lambda: log.append("op queue drained"))
    return log


def use(monkeypatch: pytest.MonkeyPatch, target: str, fast: bool) -> None:
    """Act as a process whose MindSpore target is ``target`` (the policy follows the target)."""
    monkeypatch.setattr(device, "current_target", lambda: target)
    monkeypatch.setattr(device, "_chosen", DevicePolicy.for_target(target, fast))


@pytest.mark.parametrize(
    ("target", "fast", "expected"),
    [
        ("CPU", True, []),
        ("CPU", False, ["op queue drained"]),
        ("GPU", True, ["event recorded", "event waited"]),
        ("Ascend", False, ["event recorded", "event waited"]),
    ],
)
def test_a_fence_waits_as_its_target_needs_and_only_once(monkeypatch, waits, target, fast, expected) -> None:
    use(monkeypatch, target, fast)
    fence = Fence()
    fence.wait()
    fence.wait()
    assert waits == expected


@pytest.mark.parametrize(("target", "expected"), [("CPU", []), ("GPU", ["streams synchronised"])])
def test_wait_for_reads_on_cpu_and_synchronises_devices(monkeypatch, waits, target, expected) -> None:
    use(monkeypatch, target, False)
    device.wait_for([ms.Tensor(np.ones(2, np.float32)), None])
    device.wait_for([None])
    assert waits == expected


def test_wait_until_run_waits_for_queued_work_on_cpu() -> None:
    """The real drain: after it, a result computed from queued ops is there to read."""
    x = ms.Tensor(np.arange(4, dtype=np.float32))
    y = (x * 2 + 1).sum()
    device.wait_until_run()
    assert float(y.asnumpy()) == 16.0


@pytest.mark.parametrize("dtype", [ms.bfloat16, ms.float16, ms.float32])
def test_assign_in_place_writes_every_dtype_into_the_tensors_own_memory_on_cpu(monkeypatch, dtype) -> None:
    """MindSpore 2.10's CPU ``Assign`` has no bfloat16 kernel (the preprocess broadcast of a
    bfloat16 tower failed on the device path); the write must reach the parameter a compiled
    graph reads, not a new storage. The value is a slice of a larger flat tensor, as a packed
    bucket's is (2.10's CPU in-place copy rejects such a view as its source)."""
    use(monkeypatch, "CPU", False)
    param = ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32), dtype), name="w")
    before = param.data_ptr()
    bucket = ms.Tensor(np.arange(8, dtype=np.float32), dtype)
    device.assign_in_place(param, bucket[0:6].reshape(2, 3))
    assert param.data_ptr() == before
    np.testing.assert_array_equal(param.astype(ms.float32).asnumpy().ravel(), np.arange(6))


def test_assign_in_place_uses_assign_where_the_target_has_a_bfloat16_kernel(monkeypatch) -> None:
    use(monkeypatch, "Ascend", False)
    written = []
    monkeypatch.setattr(ms.ops, "assign", lambda target, value: written.append((target, value)))
    target, value = (
        ms.Tensor(np.zeros(2, np.float32), ms.bfloat16),
        ms.Tensor(np.ones(2, np.float32), ms.bfloat16),
    )
    device.assign_in_place(target, value)
    assert written == [(target, value)]
