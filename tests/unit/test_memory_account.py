"""The runtime's memory accounting, piece by piece, on stand-in tensors (shape, dtype, nbytes),
with every figure derived by hand; and the device-or-host decision of the memory peaks."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from graph_exec import device
from graph_exec.device import DevicePolicy
from graph_exec.runtime.buffers import ReceiveBuffers
from graph_exec.runtime.memory_account import (
    MemoryAccount,
    kept_forward_bytes,
    optimizer_state_bytes,
    tensors_bytes,
)


@dataclass(frozen=True)
class FakeTensor:
    nbytes: int


@dataclass(frozen=True)
class Spec:
    """A shape and dtype without nbytes, as the executor's TensorSpec."""

    shape: tuple[int, ...]
    dtype: object


@dataclass(frozen=True)
class Kept:
    args: tuple
    outputs: tuple
    recorded: bool


def test_tensor_bytes_flatten_nested_tuples_and_skip_none() -> None:
    assert tensors_bytes((FakeTensor(8), None, (FakeTensor(4), [FakeTensor(2)]))) == 14


def test_a_spec_is_counted_from_its_shape_and_dtype() -> None:
    pytest.importorskip("mindspore")
    import mindspore as ms

    assert tensors_bytes((Spec((2, 3), ms.float32), Spec((5,), ms.bfloat16))) == 2 * 3 * 4 + 5 * 2


def test_a_taped_forward_counts_its_outputs_a_recompute_one_only_its_inputs() -> None:
    args, outs = (FakeTensor(48), FakeTensor(16)), (FakeTensor(64),)
    assert kept_forward_bytes(Kept(args, outs, recorded=True)) == 128
    assert kept_forward_bytes(Kept(args, outs, recorded=False)) == 64


def test_optimizer_state_is_what_the_optimizer_holds_beyond_the_model() -> None:
    weight, bias = FakeTensor(48), FakeTensor(12)
    optimizer = types.SimpleNamespace(
        get_parameters=lambda: [weight, bias, FakeTensor(48), FakeTensor(12), FakeTensor(4)]
    )
    assert optimizer_state_bytes(optimizer, [weight, bias]) == 64


def test_items_count_from_the_step_that_makes_them_through_the_step_that_releases_them() -> None:
    account = MemoryAccount()
    forwards: dict = {}
    steps = []

    def step(receive_bytes: int = 0) -> None:
        account.sync("activations", forwards, lambda kept: kept.nbytes)
        account.observe(receive_bytes)
        steps.append(account.peaks()["activations"])

    forwards[(0, 0)] = FakeTensor(100)
    step()  # F 0.0
    forwards[(0, 1)] = FakeTensor(100)
    step()  # F 0.1: two held
    del forwards[(0, 0)]
    step()  # B 0.0: still two during the step
    forwards[(1, 0)] = FakeTensor(30)
    step()  # F 1.0: one of stage 0, one of stage 1
    assert steps == [100, 200, 200, 200]
    peaks = account.peaks()
    assert peaks["activations_per_stage"] == {0: 200, 1: 30}
    assert peaks["activation_bytes_per_micro"] == {0: 100, 1: 30}
    assert peaks["held_peak"] == 200


def test_held_peak_is_the_peak_of_the_sum_not_the_sum_of_the_peaks() -> None:
    account = MemoryAccount()
    account.hold("preprocess_outputs", 0, (FakeTensor(40),))
    account.release_after_step("preprocess_outputs", 0)
    account.observe(0)  # 40 held
    account.hold("activations", (0, 0), (FakeTensor(50),))
    account.observe(25)  # 50 + 25 held
    peaks = account.peaks()
    assert (peaks["preprocess_outputs"], peaks["activations"], peaks["receive_slots"]) == (40, 50, 25)
    assert peaks["held_peak"] == 75
    account.begin_step()
    assert account.peaks()["held_peak"] == 0  # a new step starts from nothing


def test_a_release_twice_in_one_step_is_counted_once() -> None:
    account = MemoryAccount()
    account.hold("activations", (2, 0), (FakeTensor(64),))
    account.release_after_step("activations", (2, 0))
    account.sync("activations", {}, lambda kept: 0)  # the executor holds nothing either
    account.observe(0)
    account.observe(0)
    assert account.peaks()["activations"] == 64
    assert account._stage_now == {2: 0}


class _Slots:
    def acquire(self, nbytes: int):
        return object(), bytearray(nbytes)

    def release(self, slot) -> None:
        pass


def test_receive_buffers_count_the_bytes_of_the_messages_still_out() -> None:
    buffers = ReceiveBuffers(_Slots(), [(0, 3), (1, 1)])
    buffers.allocator(0)(100)
    buffers.allocator(1)(30)
    assert buffers.held_bytes == 130
    buffers.release_after(1)
    assert buffers.held_bytes == 100
    buffers.release_all()
    assert buffers.held_bytes == 0


@pytest.mark.parametrize(("target", "allocator"), [("CPU", None), ("GPU", 7 * 2**20), ("Ascend", 7 * 2**20)])
def test_the_allocator_peak_is_read_where_the_device_keeps_one(
    monkeypatch: pytest.MonkeyPatch, target: str, allocator: int | None
) -> None:
    calls = []
    fake = types.SimpleNamespace(
        runtime=types.SimpleNamespace(max_memory_allocated=lambda: calls.append(1) or 7 * 2**20)
    )
    monkeypatch.setitem(sys.modules, "mindspore", fake)
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target(target))
    peaks = device.memory_peaks()
    assert peaks["allocator_peak"] == allocator
    assert len(calls) == (0 if allocator is None else 1)  # CPU never asks: it would say 0
    assert peaks["peak_rss"] > 2**20  # this process holds more than a MiB, in bytes not KiB


@pytest.mark.parametrize("target", ["CPU", "GPU", "Ascend"])
def test_memory_in_use_reads_the_allocator_where_the_device_keeps_one(
    monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    fake = types.SimpleNamespace(runtime=types.SimpleNamespace(memory_allocated=lambda: 5 * 2**20))
    monkeypatch.setitem(sys.modules, "mindspore", fake)
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target(target))
    in_use = device.memory_in_use()
    if target == "CPU":  # the resident set: far more than the fake allocator's 5 MiB
        assert in_use > 10 * 2**20 and in_use != 5 * 2**20
    else:
        assert in_use == 5 * 2**20


def test_the_cpu_high_water_mark_restarts_from_now_and_the_run_peak_stays_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU: the resident set's VmHWM, reset through ``/proc/self/clear_refs``; the peak before
    the reset still reaches :func:`memory_peaks` (Linux's ``ru_maxrss`` is the reset VmHWM)."""
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target("CPU"))
    monkeypatch.setattr(device, "_peaks_before_reset", {"rss": 0, "allocator": 0})
    big = bytearray(96 * 2**20)  # zero-filled: every page touched
    del big  # a large block goes back to the system: the resident set falls, its peak stays
    peak = device.memory_peaks()["peak_rss"]
    level = device.reset_memory_high_water()
    assert device.memory_high_water() < peak - 48 * 2**20  # from now, not from the 96 MiB
    assert device.memory_peaks()["peak_rss"] >= peak
    held = bytearray(32 * 2**20)
    assert device.memory_high_water() - level >= 30 * 2**20
    del held


@pytest.mark.parametrize("target", ["GPU", "Ascend"])
def test_the_device_high_water_mark_is_the_allocators(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str
) -> None:
    """GPU/Ascend: MindSpore's allocator peak, reset by ``reset_peak_memory_stats``; the
    process's resident set is not touched, and the peak before the reset is kept."""
    state = {"peak": 9 * 2**20, "now": 5 * 2**20}

    def reset() -> None:
        state["peak"] = state["now"]

    fake = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            reset_peak_memory_stats=reset,
            max_memory_allocated=lambda: state["peak"],
            memory_allocated=lambda: state["now"],
        )
    )
    monkeypatch.setitem(sys.modules, "mindspore", fake)
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target(target))
    monkeypatch.setattr(device, "_peaks_before_reset", {"rss": 0, "allocator": 0})
    monkeypatch.setattr(device, "_CLEAR_REFS", tmp_path / "clear_refs")
    assert device.reset_memory_high_water() == 5 * 2**20
    assert device.memory_high_water() == 5 * 2**20
    state["peak"] = 6 * 2**20
    assert device.memory_high_water() == 6 * 2**20
    assert device.memory_peaks()["allocator_peak"] == 9 * 2**20  # the peak before the reset
    assert not (tmp_path / "clear_refs").exists()


def test_a_cpu_without_proc_is_refused_by_name_and_a_device_needs_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target("CPU"))
    device.check_memory_measurable()  # this machine: Linux
    monkeypatch.setattr(device, "_CLEAR_REFS", tmp_path / "clear_refs")
    with pytest.raises(device.GraphExecError, match=r"measure_tape=True .* no .*clear_refs: run it on Linux"):
        device.check_memory_measurable()
    monkeypatch.setattr(device, "policy", lambda: DevicePolicy.for_target("Ascend"))
    device.check_memory_measurable()  # the allocator's account: no /proc needed
