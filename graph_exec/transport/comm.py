"""Pipeline messaging over MindSpore communication: the only module that talks to it.

A :class:`Transport` speaks for one rank of one pipeline-parallel group. Point-to-point
transfers are *tensor groups*, sent as one data frame each (:mod:`graph_exec.transport.frames`)
with a header (:mod:`graph_exec.transport.meta`) in front only when the layout changed. Where
the back end ends a wait at the transport's deadline itself (CPU), every call runs on the
caller's thread; elsewhere calls run on the communication worker, which keeps the deadline.
Collectives (broadcast of the trainable preprocess weights, SUM all-reduce of preprocess
gradients) act in place.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graph_exec import checks
from graph_exec.device import policy, wait_for, wait_until_run
from graph_exec.errors import (
    CommunicationError,
    CommunicationNotInitializedError,
    PeerTimeoutError,
    ProtocolError,
    RemoteRankError,
    StepTagMismatchError,
    silent_peers_note,
)
from graph_exec.idle_buffers import DEFAULT_BUFFER_CACHE_BYTES
from graph_exec.transport.comm_thread import DEADLINE_SLACK_S, CommWorker
from graph_exec.transport.cpu_workarounds import (
    backend_ends_waits,
    backend_limit_is_process_wide,
    backend_wait_limit,
    bound_backend_waits,
    rebind_default_groups,
    world_barrier,
)
from graph_exec.transport.frame_memory import Allocator, HostFrames, TensorFrames, message_bytes
from graph_exec.transport.frames import (
    DATA,
    PREFIX_WORDS,
    SEQ_WORD,
    FrameLayout,
    layout_of,
    prefix_from_words,
    prefix_words,
)
from graph_exec.transport.group import CommGroup
from graph_exec.transport.meta import (
    ABORT,
    CONTROL_BYTES,
    HEADER,
    HELLO,
    GroupMeta,
    TensorMeta,
    decode,
    encode_abort,
    encode_header,
    encode_hello,
    pack_label,
    split_first_word,
)
from graph_exec.transport.p2p import point_to_point

LAUNCH_HINT = (
    "call mindspore.communication.init() at the start of the script and launch one process per "
    "rank with msrun, e.g. `msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 "
    "--master_port=8118 --join=True --cluster_time_out=60 train.py`, or use `graph-exec run`"
)


def dtype_name(dtype: Any) -> str:
    """Our name for a MindSpore dtype (``mindspore.float32`` -> ``"float32"``)."""
    return str(dtype).lower()


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


def barrier(group: CommGroup | None = None, timeout_s: float | None = None) -> None:
    """Wait until every process of ``group`` (default: the whole job) gets here, for drivers
    and tools that line ranks up between steps.

    With ``timeout_s``, a rank that does not come within it (dead, stopped, stuck) makes this
    raise :class:`PeerTimeoutError` naming the ranks waited for; without it there is no deadline
    beyond the back end's own, for callers under a launcher that bounds the whole job.
    """
    require_initialized()
    import mindspore.mint.distributed as dist

    rebind_default_groups()
    name = world_group_name() if group is None else group.name
    if timeout_s is None:
        world_barrier(dist, name)
        return
    bound_backend_waits(timeout_s)
    ranks = tuple(range(dist.get_world_size())) if group is None else group.ranks
    others = silent_peers_note(r for r in ranks if r != dist.get_rank())
    worker = _shared_worker()
    run = worker.run_here if backend_ends_waits(timeout_s) else worker.run
    run(lambda: world_barrier(dist, name), timeout_s, ("in a barrier", others))


def _others_note() -> str:
    """:func:`silent_peers_note` of every rank of the job but this one."""
    from mindspore.communication import get_group_size, get_rank

    return silent_peers_note(r for r in range(int(get_group_size())) if r != int(get_rank()))


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
    bound_backend_waits(timeout_s)
    tensor = ms.Tensor(np.ascontiguousarray(values))
    _shared_worker().run(
        lambda: dist.all_reduce(tensor, group=world_group_name()), timeout_s, (what, _others_note())
    )
    return tensor.asnumpy().copy()  # through the tensor: on a device the result is not in host memory


def all_gather_objects(value: Any, timeout_s: float, what: str) -> list[Any]:
    """Every rank's picklable ``value``, by global rank (a collective over the whole job)."""
    require_initialized()
    import mindspore.mint.distributed as dist

    rebind_default_groups()
    bound_backend_waits(timeout_s)
    out: list[Any] = [None] * dist.get_world_size()
    _shared_worker().run(
        lambda: dist.all_gather_object(out, value, group=world_group_name()),
        timeout_s,
        (what, _others_note()),
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
    run with the most recent transport; skipped if its communication is already broken (or a
    job-wide barrier or collective timed out), or if it aborted a step: a peer may then still
    sit in a collective, which this barrier (itself a collective on CPU) would join and complete
    with wrong data, as seen with a rank that failed just before ``GRADreduce``.
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
        if transport is None or transport._worker.broken is not None or transport.aborted:
            return
        if _module_worker is not None and _module_worker.broken is not None:
            return  # a job-wide barrier or collective timed out: a peer is gone or hung
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
    """Message counters for one rank (control messages included).

    ``headers_sent``/``headers_received`` count layout announcements: in steady state (same
    shapes every step) they stop growing and every transfer is one data frame.
    """

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    headers_sent: int = 0
    headers_received: int = 0
    stale_skipped: int = 0
    """Messages a restarted transport found left over from an earlier failed step and skipped."""
    all_reduces: int = 0
    """SUM all-reduces this rank joined (one per call of ``all_reduce_sum``, whatever it sums)."""


#: A tensor's identity for the layout cache: its MindSpore dtype and shape (``None`` stays).
_Signature = tuple[tuple[Any, tuple[int, ...]] | None, ...]


@dataclass
class _Outbound:
    """What this rank told one peer: the next sequence number, the layout announced per label."""

    seq: int = 0
    known: dict[str, tuple[_Signature, FrameLayout]] = field(default_factory=dict)


class _Expected:
    """The layout of one label's transfers from a peer, and the prefix its frames must carry."""

    __slots__ = ("layout", "prefix")

    def __init__(self, layout: FrameLayout, prefix: list[int]) -> None:
        self.layout = layout
        self.prefix = prefix

    def matches(self, words: list[int], seq: int) -> bool:
        """Whether a frame's prefix ``words`` are those of transfer ``seq`` under this label."""
        self.prefix[SEQ_WORD] = seq
        return words == self.prefix


@dataclass
class _Inbound:
    """What one peer told this rank: the next sequence number due, the expected frame per label."""

    seq: int = 0
    known: dict[str, _Expected] = field(default_factory=dict)


#: A "Recv failed." this close to the back end's own limit (``backend_wait_limit``) is a silent
#: peer, not a message larger than the buffer.
BACKEND_LIMIT_SLACK_S = 1.0


def _waited_out(start: float) -> float | None:
    """The seconds since ``start`` when they reach the back end's own limit, so that a call
    failing now failed because its peer was silent or gone; ``None`` otherwise."""
    waited = time.monotonic() - start
    return waited if waited >= backend_wait_limit() - BACKEND_LIMIT_SLACK_S else None


#: Bits of a transfer's sequence word that count transfers; the step tag sits above them.
_SEQ_BITS = 32
#: The largest step tag (:meth:`Transport.set_step_tag`): the sequence word stays a positive int64.
MAX_STEP_TAG = (1 << 31) - 1


#: Stale messages a restarting transport skips per peer before it gives up.
MAX_STALE_MESSAGES = 10_000
#: Transports created per group (name, global ranks) in this process: the next one's epoch.
_epochs: dict[tuple[str, tuple[int, ...]], int] = {}
#: Every transport's worker per group: a timed-out one may still sit in a receive.
_workers: dict[tuple[str, tuple[int, ...]], list[CommWorker]] = {}


def _register(group: str, ranks: tuple[int, ...], worker: CommWorker) -> int:
    """The epoch of a new transport on ``group``; refuses while an earlier one's receive may
    still be pending (it timed out), since that receive would take a later message."""
    key = (str(group), tuple(ranks))
    stuck = [w.broken for w in _workers.get(key, ()) if w.broken is not None]
    if stuck:
        raise CommunicationError(
            f"an earlier transport on ranks {list(ranks)} {stuck[0]}; its receive may still be waiting "
            "and would take a later message: restart the processes"
        )
    _workers.setdefault(key, []).append(worker)
    epoch = _epochs.get(key, 0)
    _epochs[key] = epoch + 1
    return epoch


def _header_message(words: np.ndarray, previous: tuple[_Signature, FrameLayout] | None) -> np.ndarray:
    """A header's message: its words, padded with zeros to the size of the frames the receiver
    last took under the label (its receive for the next one is posted at that size, and NCCL and
    HCCL match a message by its byte count); a label's first header is the control size."""
    if previous is None or message_bytes(previous[1]) == CONTROL_BYTES:
        return words
    message = np.zeros(message_bytes(previous[1]), np.uint8)
    message[:CONTROL_BYTES] = words.view(np.uint8)
    return message


class Transport:
    """Messaging for one rank of one communication group.

    ``group`` is a group of a :class:`~graph_exec.transport.mesh.DeviceMesh` (its pipeline
    group for the pipeline's messages, its data-parallel group for gradient averaging); the
    default is the whole world, group rank = global rank. Peers are named by group rank; the
    messages go to their global ranks. ``timeout_s`` bounds every blocking call (until
    :meth:`set_wait_bound` sets another bound).
    Point-to-point transfers (see :mod:`graph_exec.transport.frames`): a transfer is one data
    frame; a 1 KiB header goes in front only when the pair's transfer under that label changes
    layout (first time, new shapes). Every message carries the transport's *epoch*: the number
    of transports this process made for the same ranks before. A transport of epoch > 0 (a
    restart after a failed step) first exchanges hellos with every peer, skipping what the
    failed step left in the channel, so collectives and transfers start clean.

    Sends, receives and collectives run on the caller's thread when MindSpore's back end ends
    their waits at ``timeout_s`` itself (:attr:`direct`: on CPU, unless ``MS_CPU_COMM_OP_TIMEOUT``
    asks for a longer limit). This saves two thread hand-offs per transfer, and a time-out leaves
    no call behind on a thread: one the back end fails while the process exits was seen to end it
    with a C++ ``terminate``. Otherwise a communication thread keeps the deadline. Abort notices
    always go through that thread, with their own short deadline.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        group: CommGroup | None = None,
        frame_cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES,
    ) -> None:
        require_initialized()
        timeout_s = checks.positive_seconds("timeout_s", timeout_s)
        import mindspore.mint.distributed as dist

        rebind_default_groups()
        bound_backend_waits(timeout_s)
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
        self.timeout_s = timeout_s
        self.stats = TransportStats()
        #: Whether :meth:`abort` was called: this rank gave up on a step.
        self.aborted = False
        self._worker = CommWorker()
        self.epoch = _register(self.group, self.ranks, self._worker)
        chosen = policy()
        self._sends_complete_on_post = chosen.sends_complete_on_post
        self._choose_waiting()
        self._host_barrier = chosen.host_barrier
        self._synchronous_dispatch = chosen.synchronous_dispatch
        #: Where frames live: host memory on the CPU fast path, MindSpore tensors elsewhere.
        # Idle send frames are kept up to ``frame_cache_bytes`` (frame_memory.py says why).
        frames = HostFrames if chosen.host_memory_aliasing else TensorFrames
        self.frames = frames(self.epoch, frame_cache_bytes)
        self._outbound = [_Outbound() for _ in self.ranks]
        self._inbound = [_Inbound() for _ in self.ranks]
        self._label_words: dict[str, list[int]] = {}
        self._tag = 0  # the step's tag, in the high half of every transfer's sequence word
        self._describe_tag: Callable[[int], str] = str
        self._p2p = point_to_point(dist, self.group, self.ranks)
        #: What a time-out waiting for each peer, or for all of them, ends with (global ranks).
        self._silent = [silent_peers_note([r]) for r in self.ranks]
        self._silent_all = silent_peers_note(r for r in self.ranks if r != global_rank)
        _exit_barrier.track(self)
        if self.epoch > 0:
            self._resync()

    def set_wait_bound(self, timeout_s: float) -> None:
        """Bound every blocking call from now on by ``timeout_s`` (a step that may compile waits
        longer than a steady one: :mod:`graph_exec.runtime.wait_bounds`)."""
        self.timeout_s = checks.positive_seconds("timeout_s", timeout_s)
        self._choose_waiting()

    def _choose_waiting(self) -> None:
        """Wait on the caller's thread where the back end ends a wait by the bound itself."""
        self.direct = self._sends_complete_on_post and backend_ends_waits(self.timeout_s)
        self._run = self._worker.run_here if self.direct else self._worker.run

    @property
    def call_in_flight(self) -> bool:
        """Whether a call of this transport timed out on its communication thread and may still
        be running there (the transport is then unusable; calls on the caller's thread end with
        their time-out)."""
        return self._worker.broken is not None and not self.direct

    def settle(self) -> bool:
        """After a failed step: if a call of this rank timed out on its communication thread,
        wait until it has ended and the ops dispatched before it have run, so that its late error
        (a collective a peer never joined fails at the back end's limit) is absorbed here instead
        of surfacing at the next op that waits for MindSpore's pipeline (a parameter read, say).
        The drain runs on the communication thread after the call, so both waits are bounded
        together: by the back end's wait limit where it holds process-wide, else the transport's
        time-out; what still runs then is left (the job must restart either way). Nothing to do
        without such a call: the notices just posted are not waited for. Whether it settled."""
        if not self.call_in_flight:
            return True
        limit = backend_wait_limit() if backend_limit_is_process_wide() else self.timeout_s
        return self._worker.settle(limit + DEADLINE_SLACK_S, then=wait_until_run)

    # -- point to point -------------------------------------------------------------------

    def set_step_tag(self, tag: int, describe: Callable[[int], str] = str) -> None:
        """Stamp ``tag`` (``0 <= tag <= MAX_STEP_TAG``) into every transfer from now on, and
        refuse a transfer whose sender stamped another one with :class:`StepTagMismatchError`
        (``describe`` names a tag in its message). The caller's way to check, at no cost in
        messages, that the peers agree on what the step's data means (the tower placement)."""
        if not 0 <= tag <= MAX_STEP_TAG:
            raise ValueError(f"a step tag is an integer in [0, {MAX_STEP_TAG}], got {tag}")
        self._tag, self._describe_tag = tag, describe

    def _wire_seq(self, seq: int) -> int:
        """The sequence word of transfer ``seq``: the step tag above the count."""
        return (self._tag << _SEQ_BITS) | seq

    def send(self, tensors: Sequence[Any | None], dst: int, label: str) -> None:
        """Queue a tensor group for pipeline rank ``dst`` (``None`` entries stay ``None``)."""
        self._worker.require_usable()
        out = self._outbound[dst]
        signature = tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)
        known = out.known.get(label)
        header = None
        if known is None or known[0] != signature:
            meta = GroupMeta(
                label,
                tuple(
                    None if t is None else TensorMeta(dtype_name(t.dtype), tuple(t.shape)) for t in tensors
                ),
            )
            header = _header_message(encode_header(meta, self.epoch, self._wire_seq(out.seq)), known)
            known = (signature, layout_of(meta.entries))  # both raise ValueError before any message
        frame, staging = self.frames.compose(
            known[1], label, self._label(label), self._wire_seq(out.seq), tensors
        )
        header_tensor = None if header is None else self.frames.control_tensor(header)
        # With a deadline: isend usually returns at once, but to a peer that has died it blocks
        # (measured: well past 16 s), which must end in a time-out.
        self._run(
            self._post_frame,
            self.timeout_s,
            ("sending", label, "to rank", dst, self._silent[dst]),
            header_tensor,
            frame,
            staging,
            dst,
        )
        if header is not None:
            self.stats.headers_sent += 1
            out.known[label] = known
        out.seq += 1

    def recv(self, src: int, expect: str, alloc: Allocator | None = None) -> tuple[Any | None, ...]:
        """Receive the tensor group that pipeline rank ``src`` sent with label ``expect``.

        ``alloc(nbytes)`` gives each message's memory (see
        :data:`~graph_exec.transport.frame_memory.Allocator`: host arrays or MindSpore tensors, as
        :attr:`frames` needs; default: fresh memory); the tensors returned are views into it.
        """
        return self._run(
            self._fetch,
            self.timeout_s,
            ("waiting for", expect, "from rank", src, self._silent[src]),
            src,
            expect,
            alloc or self.frames.allocate,
        )

    def _fetch(self, src: int, expect: str, alloc: Allocator) -> tuple[Any | None, ...]:
        """:meth:`recv`'s work (on the calling or the communication thread)."""
        inbound = self._inbound[src]
        known = inbound.known.get(expect)
        frame, words = self._receive(
            src, expect, alloc, CONTROL_BYTES if known is None else known.layout.nbytes
        )
        if split_first_word(words[0])[0] == HEADER:
            known = self._learn_layout(src, expect, frame, inbound)
            frame, words = self._receive(src, expect, alloc, known.layout.nbytes)
        if known is None or not known.matches(words, self._wire_seq(inbound.seq)):
            self._refuse_frame(src, expect, words, known, inbound.seq)
        inbound.seq += 1
        return self.frames.tensors(known.layout, frame)

    def _post_frame(self, header: Any | None, frame: Any, staging: Any, dst: int) -> None:
        """:meth:`send`'s messages: the header, if any, then the frame."""
        if header is not None:
            self._post(header, dst, None)
        self._post(frame, dst, staging)

    def _post(self, tensor: Any, dst: int, staging: Any) -> None:
        """Send one message to pipeline rank ``dst`` and wait until the send has run.

        On a back end whose sends complete when posted (MCCL), waiting its handle is enough.
        Elsewhere the transport also waits until the send op has run
        (:func:`~graph_exec.device.wait_until_run`): with asynchronous dispatch a send to a dead
        or silent peer would otherwise fail later, inside whatever op waits next, instead of in
        this call, under its deadline and with the peer's name. Plans are validated under
        blocking sends, so waiting cannot deadlock. The staging frame is then free again.
        """
        handle = self._p2p.isend(tensor, dst)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += tensor.nbytes
        start = time.monotonic()
        try:
            handle.wait()
            if not self._sends_complete_on_post:
                wait_until_run()
        except RuntimeError as exc:  # the back end's "Send failed."
            waited = _waited_out(start)
            if waited is not None:
                raise PeerTimeoutError(
                    f"rank {self.rank}'s message to rank {dst} was not taken: MindSpore gave up after "
                    f"{waited:.0f} s ({str(exc).strip()}) {self._silent[dst]}"
                ) from exc
            raise
        self.frames.reuse(staging)

    def _label(self, label: str) -> list[int]:
        """The prefix words of ``label`` (cached: labels repeat every step)."""
        words = self._label_words.get(label)
        if words is None:
            words = self._label_words[label] = pack_label(label).tolist()
        return words

    def _learn_layout(self, src: int, expect: str, header_frame: Any, inbound: _Inbound) -> _Expected:
        """Take the header in ``header_frame`` as the layout of ``expect`` from now on (after
        checking it announces the transfer due)."""
        header = decode(self.frames.control(header_frame))
        layout = layout_of(header.meta.entries)
        if header.meta.label != expect:  # take its frame too: the channel stays in order
            self._receive(src, expect, self.frames.allocate, layout.nbytes)
        self._check(src, expect, header.epoch, header.seq, header.meta.label, inbound.seq)
        self.stats.headers_received += 1
        inbound.known[expect] = _Expected(layout, prefix_words(layout, self._label(expect), self.epoch, 0))
        return inbound.known[expect]

    def _receive(self, src: int, expect: str, alloc: Allocator, nbytes: int) -> tuple[Any, list[int]]:
        """One message from ``src`` and its first :data:`PREFIX_WORDS` words, into fresh memory of
        ``nbytes`` or, if that is less, of a control message's size (what a sender pads a frame
        to, and what an abort notice needs); raises for an abort notice."""
        size = max(nbytes, CONTROL_BYTES)
        frame = alloc(size)
        start = time.monotonic()
        try:
            self._p2p.recv(self.frames.target(frame), src)
            # Reading the prefix waits for the receive where dispatch is asynchronous: its failure
            # surfaces here.
            words = self.frames.words(frame, PREFIX_WORDS)
        except RuntimeError as exc:  # the back end's "Recv failed."
            waited = _waited_out(start)
            if waited is not None:
                raise PeerTimeoutError(
                    f"rank {self.rank} got no message from rank {src} while waiting for {expect}: MindSpore "
                    f"gave up after {waited:.0f} s ({str(exc).strip()}) {self._silent[src]}"
                ) from exc
            raise ProtocolError(
                f"rank {self.rank} could not receive {expect} from rank {src} into {size} bytes "
                f"({str(exc).strip()}): either a larger message arrived (the ranks' plans disagree) or "
                "the connection broke"
            ) from exc
        kind = split_first_word(words[0])[0]
        self.stats.messages_received += 1
        self.stats.bytes_received += words[2] if kind == DATA else CONTROL_BYTES
        if kind == ABORT:
            notice = decode(self.frames.control(frame))
            raise RemoteRankError(f"rank {src} failed: {notice.text}")
        return frame, words

    def _refuse_frame(
        self, src: int, expect: str, words: list[int], known: _Expected | None, due: int
    ) -> None:
        """Raise the :class:`ProtocolError` that says why the frame whose prefix is ``words`` is
        not the expected transfer."""
        kind = split_first_word(words[0])[0]
        if kind != DATA:
            raise ProtocolError(
                f"rank {self.rank} expected {expect} from rank {src} but received a message of kind "
                f"{kind:#x}: the message order is broken"
            )
        prefix = prefix_from_words(words)
        self._check(src, expect, prefix.epoch, prefix.seq, prefix.label, due)
        if known is None:
            raise ProtocolError(
                f"rank {self.rank} received {expect} data from rank {src} without the header that "
                "announces its shapes: the ranks' transfer histories disagree"
            )
        raise ProtocolError(
            f"rank {self.rank} received {expect} from rank {src} with layout {prefix.digest:#x} "
            f"({prefix.nbytes} bytes) but its header announced {known.layout.digest:#x} "
            f"({known.layout.nbytes} bytes): the ranks' layout caches disagree"
        )

    def _check(self, src: int, expect: str, epoch: int, seq: int, label: str, due: int) -> None:
        """Raise :class:`ProtocolError` unless a message is the transfer this rank expects."""
        where = f"rank {self.rank} expected {expect} from rank {src}"
        if epoch != self.epoch:
            raise ProtocolError(
                f"{where} but received a message of transport epoch {epoch} (this transport's is "
                f"{self.epoch}): the ranks created their transports in different orders"
            )
        if label != expect:
            raise ProtocolError(f"{where} but received {label}: the ranks' plans disagree")
        tag, seq = seq >> _SEQ_BITS, seq & ((1 << _SEQ_BITS) - 1)
        if tag != self._tag:
            describe = self._describe_tag
            raise StepTagMismatchError(
                f"{where}, of a step with {describe(self._tag)}, but rank {src}'s step has "
                f"{describe(tag)}: the ranks disagree on what this step's data is"
            )
        if seq != due:
            raise ProtocolError(
                f"{where} but received transfer #{seq} of the pair where #{due} was due: a message was "
                "lost or duplicated"
            )

    def _resync(self) -> None:
        """Exchange hellos with every peer, skipping messages an earlier transport left behind."""
        hello = self.frames.control_tensor(encode_hello(self.epoch))
        peers = [r for r in range(self.size) if r != self.rank]

        def run() -> int:
            for rank in peers:
                self._dist.isend(hello, dst=self.ranks[rank], group=self.group).wait()
            buffer = self.frames.allocate(CONTROL_BYTES)
            skipped = 0
            for rank in peers:
                while True:
                    start = time.monotonic()
                    try:
                        self._dist.recv(self.frames.target(buffer), src=self.ranks[rank], group=self.group)
                        kind, epoch = split_first_word(self.frames.words(buffer, 1)[0])
                    except RuntimeError as exc:  # a stale message larger than a control message
                        if _waited_out(start) is not None:
                            raise PeerTimeoutError(
                                f"rank {rank} sent no hello ({str(exc).strip()}) {self._silent[rank]}"
                            ) from exc
                        kind, epoch = 0, 0
                    if kind == HELLO and epoch == self.epoch:
                        break
                    if kind == HELLO and epoch > self.epoch:
                        raise ProtocolError(
                            f"rank {rank} restarted its transport {epoch} times, rank {self.rank} "
                            f"{self.epoch} times: the ranks created their transports in different orders"
                        )
                    skipped += 1
                    if skipped > MAX_STALE_MESSAGES:
                        raise ProtocolError(
                            f"rank {self.rank} found no hello from rank {rank} in {skipped} messages"
                        )
            return skipped

        skipped = self._run(run, self.timeout_s, ("exchanging hellos after a restart", self._silent_all))
        self.stats.stale_skipped = skipped
        if skipped:
            print(
                f"graph_exec: rank {self.rank} skipped {skipped} message(s) left by an earlier failed step",
                flush=True,
            )

    # -- collectives ----------------------------------------------------------------------

    def broadcast(self, tensors: Sequence[Any], src: int = 0) -> None:
        """Overwrite ``tensors`` in place with pipeline rank ``src``'s values."""
        root = self.ranks[src]

        def run() -> None:
            for tensor in tensors:
                self._dist.broadcast(tensor, src=root, group=self.group)
            self._complete(tensors)

        self._run(run, self.timeout_s, ("in broadcast from rank", src, self._silent_all))

    def all_reduce_sum(self, tensors: Sequence[Any]) -> None:
        """Sum ``tensors`` over the group, in place."""

        def run() -> None:
            for tensor in tensors:
                self._dist.all_reduce(tensor, group=self.group)
            self._complete(tensors)

        self._run(run, self.timeout_s, ("in all-reduce", self._silent_all))
        self.stats.all_reduces += 1

    def _complete(self, tensors: Sequence[Any]) -> None:
        """Where dispatch is asynchronous, wait (within the caller's deadline) until collectives
        that wrote ``tensors`` have run: a peer's failure then surfaces as this call's time-out,
        not as an error of whatever op happens to wait next."""
        if not self._synchronous_dispatch:
            wait_for(tensors)

    def barrier(self) -> None:
        """Wait until every rank of the group gets here (with the transport's deadline)."""
        self._run(
            lambda: world_barrier(self._dist, self.group, self._host_barrier),
            self.timeout_s,
            ("in a barrier", self._silent_all),
        )

    # -- failure --------------------------------------------------------------------------

    def abort(self, reason: str, grace_s: float = 2.0) -> None:
        """Best effort: tell every peer why this rank is giving up, give them time to read it,
        then let this rank's own abandoned communication end (:meth:`settle`).

        A peer blocked on a receive from this rank reports ``reason`` instead of timing out.
        The grace period matters under msrun, which kills every worker once one has exited.
        """
        self.aborted = True
        if self._worker.broken is None and self._post_abort_notices(reason):
            time.sleep(grace_s)
        self.settle()

    def _post_abort_notices(self, reason: str) -> bool:
        """Send ``reason`` to every peer; whether the sends were handed over."""
        notice = self.frames.control_tensor(encode_abort(f"rank {self.rank}: {reason}", self.epoch))

        def post() -> None:
            for rank in range(self.size):
                if rank != self.rank:
                    self._dist.isend(notice, dst=self.ranks[rank], group=self.group)

        try:
            self._worker.run(post, min(self.timeout_s, 10.0), "sending abort notices")
        except Exception:  # best effort: the failure being reported matters more
            return False
        return True
