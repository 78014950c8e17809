"""The device policy: every CPU fast path is on for CPU by default, off with
``GRAPH_EXEC_CPU_FAST_PATHS=0`` and off on every other target; target primitives follow the
target only."""

from __future__ import annotations

import dataclasses

import pytest

from graph_exec import device
from graph_exec.device import DevicePolicy

FAST_PATHS = [
    "host_memory_aliasing",
    "synchronous_dispatch",
    "sends_complete_on_post",
    "backend_bounds_waits",
    "host_barrier",
    "host_accumulation",
    "host_gradient_math",
    "packing_by_address",
    "storage_by_address",
    "sync_steps_default",
]


def test_every_decision_is_either_a_fast_path_or_a_target_primitive() -> None:
    fields = {f.name for f in dataclasses.fields(DevicePolicy)}
    primitives = {
        "pin_cores",
        "device_per_rank",
        "has_streams",
        "assign_has_bfloat16",
        "computes_bfloat16",
        "allocator_reports_peak",
    }
    assert fields == {"target", "cpu_fast_paths", *primitives, *FAST_PATHS}


@pytest.mark.parametrize(
    ("target", "fast", "expected"),
    [("CPU", True, True), ("CPU", False, False), ("GPU", True, False), ("Ascend", True, False)],
)
def test_fast_paths_only_on_cpu_and_only_when_asked(target: str, fast: bool, expected: bool) -> None:
    chosen = DevicePolicy.for_target(target, fast)
    assert chosen.cpu_fast_paths is expected
    assert {name: getattr(chosen, name) for name in FAST_PATHS} == dict.fromkeys(FAST_PATHS, expected)


@pytest.mark.parametrize("fast", [True, False])
def test_target_primitives_do_not_depend_on_the_switch(fast: bool) -> None:
    cpu, gpu = DevicePolicy.for_target("CPU", fast), DevicePolicy.for_target("GPU", fast)
    assert (cpu.pin_cores, cpu.device_per_rank, cpu.has_streams, cpu.assign_has_bfloat16) == (
        True,
        False,
        False,
        False,
    )
    assert (gpu.pin_cores, gpu.device_per_rank, gpu.has_streams, gpu.assign_has_bfloat16) == (
        False,
        True,
        True,
        True,
    )
    assert (cpu.computes_bfloat16, gpu.computes_bfloat16) == (False, True)


def test_an_unknown_target_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"CPU, GPU, Ascend, got 'TPU'"):
        DevicePolicy.for_target("TPU")


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("yes", True), ("0", False), ("off", False), ("False", False)],
)
def test_the_switch_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    if value is None:
        monkeypatch.delenv(device.FAST_PATHS_ENV, raising=False)
    else:
        monkeypatch.setenv(device.FAST_PATHS_ENV, value)
    assert device.fast_paths_requested() is on


def test_the_policy_follows_mindspores_target_and_reads_the_switch_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A script that asked before choosing its device (``import graph_exec.models`` does) gets
    the chosen device's policy afterwards, not a CPU policy kept from MindSpore's default."""
    targets = ["CPU"]
    monkeypatch.setattr(device, "_fast_paths", None)
    monkeypatch.setattr(device, "_chosen", None)
    monkeypatch.setattr(device, "current_target", lambda: targets[0])
    monkeypatch.setenv(device.FAST_PATHS_ENV, "0")
    first = device.policy()
    monkeypatch.setenv(device.FAST_PATHS_ENV, "1")  # too late: read at the first call
    assert device.policy() is first  # the same target: the same policy
    assert not first.cpu_fast_paths
    targets[0] = "Ascend"  # mindspore.set_device("Ascend") after the first read
    again = device.policy()
    assert again.target == "Ascend" and again.has_streams and device.policy() is again


def test_the_target_read_is_mindspores_own() -> None:
    import mindspore as ms

    assert device.current_target() == ms.get_context("device_target") == "CPU"
