"""Pipeline messaging over MindSpore communication: the only module that talks to it.

A :class:`Transport` speaks for one rank of one pipeline-parallel group. Point-to-point
transfers are *tensor groups*: one header (:mod:`graph_exec.transport.meta`) then one message
per tensor. Sends are asynchronous (``isend``) and are drained at the end of a step; receives
block, on the communication worker, with a deadline. Collectives (broadcast of the trainable
preprocess weights, SUM all-reduce of preprocess gradients) act in place.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graph_exec.errors import CommunicationNotInitializedError, ProtocolError, RemoteRankError
from graph_exec.transport.comm_thread import CommWorker
from graph_exec.transport.cpu_workarounds import rebind_default_groups, world_barrier
from graph_exec.transport.mesh import CommGroup
from graph_exec.transport.meta import (
    META_WORDS,
    AbortNotice,
    GroupMeta,
    TensorMeta,
    decode,
    encode_abort,
    encode_group,
)

#: Builds the receive tensor for one incoming payload (the runtime passes a pool-backed one).
Allocator = Callable[[TensorMeta], Any]

LAUNCH_HINT = (
    "call mindspore.communication.init() at the start of the script and launch one process per "
    "rank with msrun, e.g. `msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 "
    "--master_port=8118 --join=True --cluster_time_out=60 train.py`, or use `graph-exec run`"
)


def dtype_name(dtype: Any) -> str:
    """Our name for a MindSpore dtype (``mindspore.float32`` -> ``"float32"``)."""
    return str(dtype).lower()


def mindspore_dtype(name: str) -> Any:
    """The MindSpore dtype for one of our dtype names."""
    import mindspore as ms

    return getattr(ms, "bool_" if name == "bool" else name)


def numpy_allocator(meta: TensorMeta) -> Any:
    """A fresh host tensor for ``meta`` (used where no buffer pool is wired in)."""
    import mindspore as ms
    from mindspore import ops

    if meta.dtype == "bfloat16":  # numpy has no bfloat16
        return ops.zeros(meta.shape, ms.bfloat16)
    return ms.from_numpy(np.empty(meta.shape, dtype=np.dtype(meta.dtype)))


def is_initialized() -> bool:
    """Whether ``mindspore.communication.init()`` has run in this process."""
    from mindspore.communication import GlobalComm

    return bool(GlobalComm.INITED)


def pipeline_rank() -> int:
    """This process's rank in the pipeline (the world rank; 0 without communication)."""
    if not is_initialized():
        return 0
    from mindspore.communication import get_rank

    return int(get_rank())


def world_group_name() -> str:
    """MindSpore's name of the group of all ranks."""
    from mindspore.communication import GlobalComm

    return str(GlobalComm.WORLD_COMM_GROUP)


def barrier(group: CommGroup | None = None) -> None:
    """Wait until every process of ``group`` (default: the whole job) gets here (no deadline:
    for drivers and tools that line ranks up between steps, under a launcher that bounds the
    whole job)."""
    require_initialized()
    import mindspore.mint.distributed as dist

    rebind_default_groups()
    world_barrier(dist, world_group_name() if group is None else group.name)


def _shared_worker() -> CommWorker:
    """One worker for the module-level collectives that need a deadline (made on first use)."""
    global _module_worker
    if _module_worker is None:
        _module_worker = CommWorker("graph_exec-comm-setup")
    return _module_worker


_module_worker: CommWorker | None = None


def world_all_reduce_sum(values: np.ndarray, timeout_s: float, what: str) -> np.ndarray:
    """The SUM of ``values`` over every rank of the job, waiting at most ``timeout_s``
    (float64 is refused by the CPU backend: pass float32 or an integer type)."""
    require_initialized()
    import mindspore as ms
    import mindspore.mint.distributed as dist

    rebind_default_groups()
    out = np.ascontiguousarray(values).copy()
    tensor = ms.from_numpy(out)
    _shared_worker().run(lambda: dist.all_reduce(tensor, group=world_group_name()), timeout_s, what)
    return out


def all_gather_objects(value: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's picklable ``value``, by global rank (a collective over the whole job)."""
    require_initialized()
    import mindspore.mint.distributed as dist

    rebind_default_groups()
    out: list[Any] = [None] * dist.get_world_size()
    _shared_worker().run(
        lambda: dist.all_gather_object(out, value, group=world_group_name()), timeout_s, what
    )
    return out


def require_initialized() -> None:
    """Raise a clear error, with launch instructions, if communication is not initialised."""
    if not is_initialized():
        raise CommunicationNotInitializedError(f"MindSpore communication is not initialised: {LAUNCH_HINT}")


class _ExitBarrier:
    """At interpreter exit, wait briefly until every rank gets there (one barrier per process).

    A message's sender may still be waiting for the receiver's acknowledgement when the
    receiver has already returned from its last receive; if the receiver's process exits at
    that moment, the sender fails with "Send failed" (seen with MCCL on CPU). Registered once,
    run with the most recent transport; skipped if its communication is already broken.
    Registered when the first transport exists, hence after MindSpore's own exit handlers,
    which therefore run after it (exit handlers run last-registered first).
    """

    def __init__(self) -> None:
        self.latest: Transport | None = None

    def track(self, transport: Transport) -> None:
        if self.latest is None:
            atexit.register(self)
        self.latest = transport

    def __call__(self, timeout_s: float = 10.0) -> None:
        transport = self.latest
        if transport is None or transport._worker.broken is not None:
            return
        from mindspore.communication import GlobalComm

        try:
            transport._worker.run(
                lambda: world_barrier(transport._dist, GlobalComm.WORLD_COMM_GROUP),
                timeout_s,
                "in the exit barrier",
            )
        except Exception:  # exiting anyway: a missing peer must not turn into a hang or a traceback
            return


_exit_barrier = _ExitBarrier()


@dataclass
class TransportStats:
    """Message counters for one rank (headers included)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0


def _nbytes(tensor: Any) -> int:
    return int(tensor.nbytes)


class Transport:
    """Messaging for one rank of one communication group.

    ``group`` is a group of a :class:`~graph_exec.transport.mesh.DeviceMesh` (its pipeline
    group for the pipeline's messages, its data-parallel group for gradient averaging); the
    default is the whole world, group rank = global rank. Peers are named by group rank; the
    messages go to their global ranks. ``timeout_s`` bounds every blocking call.
    """

    def __init__(self, *, timeout_s: float = 300.0, group: CommGroup | None = None) -> None:
        require_initialized()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        import mindspore.mint.distributed as dist

        rebind_default_groups()
        self._dist = dist
        world = dist.get_world_size()
        global_rank = dist.get_rank()
        if group is None:
            group = CommGroup(world_group_name(), tuple(range(world)))
        if global_rank not in group.ranks:
            raise ValueError(f"global rank {global_rank} is not in group {group.name!r} {list(group.ranks)}")
        self.ranks = group.ranks
        self.rank = group.rank_of(global_rank)
        self.size = group.size
        self.group = group.name
        self.timeout_s = float(timeout_s)
        self.stats = TransportStats()
        self._worker = CommWorker()
        self._pending: list[tuple[Any, tuple[Any, ...]]] = []  # (handle, tensors kept alive until sent)
        self._header = np.zeros(META_WORDS, dtype=np.int64)
        import mindspore as ms

        self._header_tensor = ms.from_numpy(self._header)
        _exit_barrier.track(self)

    # -- point to point -------------------------------------------------------------------

    def send(self, tensors: Sequence[Any | None], dst: int, label: str) -> None:
        """Queue a tensor group for pipeline rank ``dst`` (``None`` entries stay ``None``)."""
        import mindspore as ms

        entries = tuple(
            None if t is None else TensorMeta(dtype_name(t.dtype), tuple(t.shape)) for t in tensors
        )
        header = ms.from_numpy(encode_group(GroupMeta(label, entries)))
        payload = tuple(t for t in tensors if t is not None and t.size > 0)
        peer = self.ranks[dst]

        # Posted by the worker, with the deadline: isend usually returns at once, but to a peer
        # that has died it blocks (measured: well past 16 s), which must end in a time-out.
        def post() -> None:
            for tensor in (header, *payload):
                handle = self._dist.isend(tensor, dst=peer, group=self.group)
                self._pending.append((handle, (tensor,)))
                self.stats.messages_sent += 1
                self.stats.bytes_sent += _nbytes(tensor)

        self._worker.run(post, self.timeout_s, f"sending {label} to rank {dst}")

    def recv(self, src: int, expect: str, alloc: Allocator = numpy_allocator) -> tuple[Any | None, ...]:
        """Receive the tensor group that pipeline rank ``src`` sent with label ``expect``."""
        peer = self.ranks[src]

        def fetch() -> tuple[Any | None, ...]:
            self._dist.recv(self._header_tensor, src=peer, group=self.group)
            notice = decode(self._header.copy())
            self.stats.messages_received += 1
            self.stats.bytes_received += META_WORDS * 8
            if isinstance(notice, AbortNotice):
                raise RemoteRankError(f"rank {src} failed: {notice.text}")
            if notice.label != expect:
                raise ProtocolError(
                    f"rank {self.rank} expected {expect} from rank {src} but received {notice.label}: "
                    "the ranks' plans disagree"
                )
            out: list[Any | None] = []
            for meta in notice.entries:
                if meta is None:
                    out.append(None)
                    continue
                tensor = alloc(meta)
                if meta.numel > 0:
                    self._dist.recv(tensor, src=peer, group=self.group)
                    self.stats.messages_received += 1
                    self.stats.bytes_received += _nbytes(tensor)
                out.append(tensor)
            return tuple(out)

        return self._worker.run(fetch, self.timeout_s, f"waiting for {expect} from rank {src}")

    def drain(self) -> None:
        """Wait until every queued send has left (end of a step, or before reusing buffers)."""

        def wait_all() -> None:
            while self._pending:
                handle, _ = self._pending.pop(0)
                handle.wait()

        self._worker.run(wait_all, self.timeout_s, "draining pending sends")

    # -- collectives ----------------------------------------------------------------------

    def broadcast(self, tensors: Sequence[Any], src: int = 0) -> None:
        """Overwrite ``tensors`` in place with pipeline rank ``src``'s values."""
        root = self.ranks[src]

        def run() -> None:
            for tensor in tensors:
                self._dist.broadcast(tensor, src=root, group=self.group)

        self._worker.run(run, self.timeout_s, f"in broadcast from rank {src}")

    def all_reduce_sum(self, tensors: Sequence[Any]) -> None:
        """Sum ``tensors`` over the group, in place."""

        def run() -> None:
            for tensor in tensors:
                self._dist.all_reduce(tensor, group=self.group)

        self._worker.run(run, self.timeout_s, "in all-reduce")

    def barrier(self) -> None:
        """Wait until every rank of the group gets here (with the transport's deadline)."""
        self._worker.run(lambda: world_barrier(self._dist, self.group), self.timeout_s, "in a barrier")

    # -- failure --------------------------------------------------------------------------

    def abort(self, reason: str, grace_s: float = 2.0) -> None:
        """Best effort: tell every peer why this rank is giving up, then give them time to read it.

        A peer blocked on a receive from this rank reports ``reason`` instead of timing out.
        The grace period matters under msrun, which kills every worker once one has exited.
        """
        if self._worker.broken is not None:
            return
        import mindspore as ms

        notice = ms.from_numpy(encode_abort(f"rank {self.rank}: {reason}"))

        def post() -> None:
            for rank in range(self.size):
                if rank != self.rank:
                    self._dist.isend(notice, dst=self.ranks[rank], group=self.group)

        try:
            self._worker.run(post, min(self.timeout_s, 10.0), "sending abort notices")
        except Exception:  # best effort: the failure being reported matters more
            return
        time.sleep(grace_s)
