"""Every device-dependent decision of the library, made in one place, once per device target.

The library runs on MindSpore's CPU, GPU and Ascend targets. Most of its code is the same on
all of them; where it is not, the choice is a named field of :class:`DevicePolicy`, and every
other module asks :func:`policy` instead of comparing ``device_target`` itself. Two kinds of
decision live here:

*CPU fast paths.* Shortcuts that are right only because MindSpore's CPU target keeps a tensor in
this process's host memory and (with ``launch_blocking``) runs each op before it returns:
reading received bytes through the numpy array a tensor was made from, copying by
``data_ptr()``, adding gradients and packing buckets by address, synchronous dispatch, sends
that complete when posted, a waits-bounding back end. They were each measured to save time on
CPU (see the field docs). ``GRAPH_EXEC_CPU_FAST_PATHS=0`` (read once per process) turns every
one of them off, so that a CPU process takes exactly the path an Ascend or GPU rank takes:
no reads of memory behind a tensor, no ``data_ptr()``, MindSpore's asynchronous dispatch, the
real barrier. That is how the device path is tested on a machine without an accelerator (the
test suite runs its multi-rank numerics and failure tests both ways).

*Target primitives.* Things every target does, in its own way: waiting until dispatched work
has run (a stream synchronisation on GPU/Ascend, draining MindSpore's op queue on CPU, which has
no streams), marking a point in the work (an event), binding ranks to cores (CPU only: a device
rank owns its device). These do not depend on the fast-path switch.

Nothing here imports ``mindspore.communication``; MindSpore itself is imported only when a
policy is first needed, so this module is importable anywhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from graph_exec.errors import GraphExecError

#: Environment variable that turns the CPU fast paths off (``0``); read once per process.
FAST_PATHS_ENV = "GRAPH_EXEC_CPU_FAST_PATHS"
#: Device targets MindSpore offers (``mindspore.set_device`` names).
TARGETS = ("CPU", "GPU", "Ascend")


def fast_paths_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment (default: this process's) leaves the CPU fast paths on: anything
    but ``0``, ``false``, ``off`` or ``no``; unset means on."""
    value = (os.environ if environ is None else environ).get(FAST_PATHS_ENV, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


@dataclass(frozen=True)
class DevicePolicy:
    """What this process does where targets differ (build with :meth:`for_target`)."""

    target: str
    """MindSpore's device target: ``"CPU"``, ``"GPU"`` or ``"Ascend"``."""
    cpu_fast_paths: bool
    """Whether the CPU fast paths below are on (CPU, and ``GRAPH_EXEC_CPU_FAST_PATHS`` not 0)."""

    host_memory_aliasing: bool
    """A tensor made with ``mindspore.from_numpy(array)`` is that array's memory, and a
    communication op that writes the tensor has written the array by the time it returns; a
    tensor's ``data_ptr()`` is a host address. The transport then receives into pool blocks
    (host memory), reads a frame's prefix through its numpy view (about 5 us saved per receive
    against ``asnumpy``) and copies a contiguous tensor into its send frame by address. Off:
    receive into MindSpore tensors (one per buffer slot) and read them only with ``asnumpy``
    after the op that wrote them."""
    synchronous_dispatch: bool
    """``mindspore.runtime.launch_blocking()`` and ``MS_DEV_HOST_BLOCKING_RUN=1``: every op runs
    before its call returns, on the calling thread. On a small CPU machine the asynchronous
    pipeline was measured 2.5-15x slower (eager compute and communication alike), and the host
    tasks handed to MindSpore's pipeline threads made a 2-rank ``embed_lm`` graph-mode step 1.5x
    slower. Off: MindSpore's default asynchronous dispatch (what Ascend runs)."""
    sends_complete_on_post: bool
    """An ``isend`` has taken its data when it returns (MCCL, measured), so waiting its handle
    is all the transport does before reusing the staging memory. Off: the transport also waits
    until the send op has run (:func:`wait_until_run`), within the send's deadline, so that a
    send to a dead or silent peer fails in its own call and not in whatever op waits next."""
    backend_bounds_waits: bool
    """MindSpore's CPU back end fails a send, receive or collective after
    ``MS_CPU_COMM_OP_TIMEOUT`` seconds, so the transport can call it on the caller's thread
    (no hand-off to a deadline thread, about 50 us each way saved per transfer). Off: every
    call goes through the communication thread that keeps the transport's deadline."""
    host_barrier: bool
    """A barrier is a blocking one-element all-reduce (``mint.distributed.barrier`` ends in a
    stream synchronisation that on CPU only logs "CPU device is not supported" as an error).
    Off: MindSpore's own ``barrier``."""
    host_accumulation: bool
    """Gradients of float32/float64 parameters are added into their accumulators in host
    memory, by address, in C++ (about 1.5 us per parameter against an eager ``assign_add``'s
    dispatch). Off: eager ``ops.assign_add``."""
    host_gradient_math: bool
    """The arithmetic over all gradient accumulators at a step's end (unscaling with the
    overflow check and a norm's share, scaling in place by a clip factor, zeroing, setting
    earlier gradients aside) runs on their host memory, by address in C++ over float32/float64
    accumulators (``kernels.grad_ops.HostGradients``), after waiting for the queued ops, where
    a compiled kernel over every accumulator pays MindSpore's CPU launch cost for every op in
    it (measured on the 66 accumulators of a 4-stage ``embed_lm`` tiny: ``mindspore.amp
    .all_finite`` 15.5 ms, the 2-norm kernel 9.7 ms, the scale kernel 6.9 ms per call; on the
    38 of a rank of ``embed_lm`` small the C++ unscale-check-share takes 0.17 ms, against 1.04
    ms through numpy views and 0.74 ms for the compiled zeroing alone). Off: those compiled
    kernels and ``mindspore.amp.all_finite``."""
    packing_by_address: bool
    """Flat collective buckets (broadcast, gradient reduce, data-parallel average) are packed
    and unpacked by address with the arithmetic in numpy (``ops.cat``/``ops.assign`` cost more
    than the collective itself on CPU). Off: packed and written back with MindSpore ops."""
    storage_by_address: bool
    """The graph executor notices a ``Parameter.set_data`` (which swaps the storage a compiled
    graph still reads) by comparing the parameters' ``data_ptr()`` before each call: on CPU it
    costs well under a microsecond. Off: ``data_ptr()`` waits for the ops that write a tensor,
    which would serialise asynchronous dispatch, so the executor counts the parameters'
    ``set_data`` calls instead."""
    sync_steps_default: bool
    """The schedules' ``sync_steps=None`` default: wait for each compute step's results before
    the next step (measured 2-3x faster on CPU, where asynchronous dispatch is slow). Off:
    steps are dispatched without waiting."""
    pin_cores: bool
    """Bind each local rank to its own share of the CPU cores (``graph-exec run``/``bench``), as
    ranks on separate devices would be: the target is the CPU itself."""
    device_per_rank: bool
    """Each rank owns one device of its host and selects it by its local rank (``device_id`` of
    ``mindspore.set_device``); on CPU there is nothing to select."""
    has_streams: bool
    """The target has device streams and events (GPU, Ascend); on CPU there is only
    MindSpore's op queue to wait for."""
    allocator_reports_peak: bool
    """MindSpore's allocator keeps the peak of the device memory it handed out
    (``mindspore.runtime.max_memory_allocated``, GPU and Ascend), a counter read without a
    synchronisation. On CPU a tensor is host memory of this process and that call returns 0
    (measured, MindSpore 2.10): the process's peak resident set is the figure there
    (:func:`memory_peaks`)."""
    assign_has_bfloat16: bool
    """MindSpore's ``Assign`` has a bfloat16 kernel (GPU, Ascend). MindSpore 2.10's CPU target
    has none (``ops.assign`` of a bfloat16 tensor fails), so :func:`assign_in_place` writes
    bfloat16 tensors there with ``Tensor.copy_`` (its in-place copy has one)."""
    computes_bfloat16: bool
    """The target multiplies bfloat16 matrices (GPU, Ascend). MindSpore 2.10's CPU target has no
    bfloat16 MatMul, so a BF16 checkpoint is loaded as its exact float32 values there
    (``load_split``'s ``dtype=None``) and kept in BF16 on devices."""

    @classmethod
    def for_target(cls, target: str, cpu_fast_paths: bool = True) -> DevicePolicy:
        """The policy of a process on ``target`` (``cpu_fast_paths`` matters on CPU only)."""
        if target not in TARGETS:
            raise ValueError(f"device target must be one of {', '.join(TARGETS)}, got {target!r}")
        fast = target == "CPU" and bool(cpu_fast_paths)
        return cls(
            target=target,
            cpu_fast_paths=fast,
            host_memory_aliasing=fast,
            synchronous_dispatch=fast,
            sends_complete_on_post=fast,
            backend_bounds_waits=fast,
            host_barrier=fast,
            host_accumulation=fast,
            host_gradient_math=fast,
            packing_by_address=fast,
            storage_by_address=fast,
            sync_steps_default=fast,
            pin_cores=target == "CPU",
            device_per_rank=target != "CPU",
            has_streams=target != "CPU",
            allocator_reports_peak=target != "CPU",
            assign_has_bfloat16=target != "CPU",
            computes_bfloat16=target != "CPU",
        )

    def describe(self) -> str:
        """One line for logs and reports."""
        if self.target != "CPU":
            return f"{self.target} (device path)"
        return "CPU (fast paths)" if self.cpu_fast_paths else f"CPU (device path: {FAST_PATHS_ENV}=0)"


#: A device target's device files (one per device, in ``/dev``) and its visible-devices list.
_DEVICE_FILES = {"GPU": re.compile(r"nvidia(\d+)"), "Ascend": re.compile(r"davinci(\d+)")}
_VISIBLE_ENV = {"GPU": "CUDA_VISIBLE_DEVICES", "Ascend": "ASCEND_RT_VISIBLE_DEVICES"}


def usable_ranks(
    target: str, environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")
) -> int | None:
    """How many ranks this host can run now on ``target``: a relaunch after a failure asks, to
    go on with fewer ranks when a device is gone (``graph-exec run --min-ranks``).

    GPU and Ascend: one rank per device, counted as the devices whose file is present in ``dev``
    (``nvidia<N>``, ``davinci<N>``: a device the driver dropped loses its file), and of those
    only the numbers the visible-devices variable lists when it is set. ``None`` on CPU: a rank is
    a process, nothing to run out of.
    A probe of presence, not of health: a device that is present but broken fails the relaunch,
    which is then a failure of its own.
    """
    if target not in _DEVICE_FILES:
        return None
    pattern = _DEVICE_FILES[target]
    present = sorted(int(m.group(1)) for p in dev.glob("*") if (m := pattern.fullmatch(p.name)))
    listed = (os.environ if environ is None else environ).get(_VISIBLE_ENV[target])
    if listed is None:
        return len(present)
    wanted = [item.strip() for item in listed.split(",") if item.strip()]
    return sum(1 for item in wanted if item.isdigit() and int(item) in present)


_chosen: DevicePolicy | None = None
_fast_paths: bool | None = None
#: Reads MindSpore's device target (bound at the first :func:`current_target`).
_read_target: Callable[[], str] | None = None


def current_target() -> str:
    """MindSpore's device target now, what ``mindspore.get_context("device_target")`` returns.

    Read straight from MindSpore's context (``MSContext.get_param``, the value ``get_context``
    returns after validating its argument): well under a microsecond against about 18 us, so
    that :func:`policy` can read it on every call. Imports MindSpore at the first call.
    """
    global _read_target
    if _read_target is None:
        from mindspore._c_expression import MSContext, ms_ctx_param

        _read_target = partial(MSContext.get_instance().get_param, ms_ctx_param.device_target)
    return _read_target()


def policy() -> DevicePolicy:
    """This process's policy, for MindSpore's device target now.

    The target is read on every call (:func:`current_target`, well under a microsecond) and the
    policy made again when it differs from the one the policy was made for: a script that asked
    before it chose its device (``import graph_exec.models`` does) gets the chosen device's
    policy from then on, not the CPU's of MindSpore's default. The fast-path switch is read from
    the environment once.
    """
    global _chosen, _fast_paths
    target = current_target()
    if _chosen is None or _chosen.target != target:
        if _fast_paths is None:
            _fast_paths = fast_paths_requested()
        _chosen = DevicePolicy.for_target(target, _fast_paths)
    return _chosen


def choose_again() -> DevicePolicy:
    """Make the policy again for MindSpore's device target now (:func:`policy` also does when
    the target changed)."""
    global _chosen
    _chosen = None
    return policy()


def wait_until_run() -> None:
    """Block until every op dispatched so far by this process has run.

    On GPU and Ascend: MindSpore's synchronisation of every stream of the device. On CPU there
    are no streams; draining MindSpore's op queue is the same wait (``mindspore.runtime
    .synchronize`` is not supported there: its first call only logs an error).
    """
    if policy().has_streams:
        import mindspore as ms

        ms.runtime.synchronize()
        return
    _drain_op_queue()


def _drain_op_queue() -> None:
    """Wait until MindSpore's queue of dispatched ops is empty (the CPU target's only queue)."""
    from mindspore.common.api import _pynative_executor

    _pynative_executor.sync()


def memory_peaks() -> dict[str, int | None]:
    """This process's memory peaks in bytes: ``peak_rss`` (the most host memory it has held,
    ``getrusage``), and ``allocator_peak``, MindSpore's peak of the device memory it allocated,
    where the device keeps one (:attr:`DevicePolicy.allocator_reports_peak`; ``None`` on CPU,
    whose tensors the resident set already counts)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = int(rss) if sys.platform == "darwin" else int(rss) * 1024  # Linux: KiB
    peaks: dict[str, int | None] = {
        "peak_rss": max(rss_bytes, _peaks_before_reset["rss"]),
        "allocator_peak": None,
    }
    if policy().allocator_reports_peak:
        import mindspore as ms

        peaks["allocator_peak"] = max(
            int(ms.runtime.max_memory_allocated()), _peaks_before_reset["allocator"]
        )
    return peaks


#: The process's peaks before the last :func:`reset_memory_high_water` (it lowers the counters
#: :func:`memory_peaks` reads: Linux's ``ru_maxrss`` is VmHWM), so the whole-run peak stays whole.
_peaks_before_reset = {"rss": 0, "allocator": 0}
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATM = Path("/proc/self/statm")


def _vm_hwm() -> int:
    """The resident set's high-water mark (``VmHWM`` of ``/proc/self/status``), in bytes."""
    for line in _STATUS.read_text(encoding="ascii").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{_STATUS} has no VmHWM line")


def reset_memory_high_water() -> int:
    """Start a new high-water mark of memory in use from now (what :func:`memory_high_water`
    then reads); returns the memory in use now. The peaks so far are kept for
    :func:`memory_peaks`.

    The same decision as :func:`memory_in_use`, :attr:`DevicePolicy.allocator_reports_peak`:
    where the device keeps an allocator account, MindSpore's
    ``mindspore.runtime.reset_peak_memory_stats`` (then ``max_memory_allocated``); on CPU, the
    resident set's high-water mark, reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux)
    and read from ``VmHWM``: MindSpore's CPU pool takes host memory as it grows, so its peak is
    the resident set's.
    """
    previous = memory_peaks()
    _peaks_before_reset["rss"] = int(previous["peak_rss"] or 0)
    _peaks_before_reset["allocator"] = int(previous["allocator_peak"] or 0)
    if policy().allocator_reports_peak:
        import mindspore as ms

        ms.runtime.reset_peak_memory_stats()
    else:
        _CLEAR_REFS.write_text("5", encoding="ascii")
    return memory_in_use()


def check_memory_measurable() -> None:
    """Refuse, by name, a platform where :func:`memory_in_use` and the high-water mark cannot
    be read: on CPU they come from Linux's ``/proc/self`` (``statm``, ``status``,
    ``clear_refs``); a device reads its allocator's account and needs nothing more."""
    if policy().allocator_reports_peak:
        return
    missing = [str(p) for p in (_STATM, _STATUS, _CLEAR_REFS) if not p.exists()]
    if missing:
        raise GraphExecError(
            f"measure_tape=True measures memory on CPU from Linux's /proc, and this system has no "
            f"{', '.join(missing)}: run it on Linux, or on a device whose allocator keeps an account"
        )


def memory_high_water() -> int:
    """The most memory in use since the last :func:`reset_memory_high_water` (bytes): the
    allocator's peak where the device keeps one, else the resident set's ``VmHWM``."""
    if policy().allocator_reports_peak:
        import mindspore as ms

        return int(ms.runtime.max_memory_allocated())
    return _vm_hwm()


def memory_in_use() -> int:
    """Bytes in use now: MindSpore's allocator where the device keeps its own account
    (:attr:`DevicePolicy.allocator_reports_peak`), else the process's resident set (on CPU
    tensors are host memory, and 2.10's allocator reports 0 there)."""
    if policy().allocator_reports_peak:
        import mindspore as ms

        return int(ms.runtime.memory_allocated())
    import os

    with open(_STATM, encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def assign_in_place(target: Any, value: Any) -> None:
    """Write ``value`` into ``target``'s own memory (a compiled graph reading ``target`` sees
    it): ``ops.assign``, or ``Tensor.copy_`` for a bfloat16 tensor where ``Assign`` has no
    bfloat16 kernel (:attr:`DevicePolicy.assign_has_bfloat16`). ``value`` is copied to a tensor
    of its own first: 2.10's CPU ``InplaceCopy`` rejects a source that is a view on a larger
    tensor (a slice of a packed bucket) with "an unexpected kernel has been launched"."""
    import mindspore as ms

    if target.dtype == ms.bfloat16 and not policy().assign_has_bfloat16:
        target.copy_(value.copy())
        return
    ms.ops.assign(target, value)


def wait_for(tensors: Iterable[Any]) -> None:
    """Block until every tensor of ``tensors`` (``None`` entries skipped) has been computed.

    On CPU each tensor is read (``asnumpy`` waits for the op that makes it and copies nothing
    off a device); on GPU and Ascend reading would copy every tensor to the host, so the
    device's streams are synchronised instead.
    """
    present = [tensor for tensor in tensors if tensor is not None]
    if not present:
        return
    if policy().has_streams:
        wait_until_run()
        return
    for tensor in present:
        tensor.asnumpy()


class Fence:
    """A mark after the work dispatched so far; :meth:`wait` returns once that work has run.

    Used before a buffer is written again (a receive into a reused slot) while earlier ops may
    still read it. With synchronous dispatch everything has run already and the fence is free.
    On GPU and Ascend it is a MindSpore event recorded on the current stream (waiting blocks
    the host until the stream reaches it). On CPU with asynchronous dispatch MindSpore offers no
    events, so waiting drains the op queue (:func:`wait_until_run`), which covers the mark.
    """

    __slots__ = ("_event", "_pending")

    def __init__(self) -> None:
        current = policy()
        self._pending = not current.synchronous_dispatch
        self._event = None
        if self._pending and current.has_streams:
            import mindspore as ms

            self._event = ms.runtime.Event()
            self._event.record()

    def wait(self) -> None:
        """Return once the work dispatched before this fence was made has run."""
        if not self._pending:
            return
        if self._event is not None:
            self._event.synchronize()
        else:
            _drain_op_queue()
        self._pending = False
