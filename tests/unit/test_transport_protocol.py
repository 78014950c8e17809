"""The transfer protocol of :class:`Transport`, on two transports in one process.

A fake message layer stands in for ``mindspore.mint.distributed`` and behaves as MindSpore 2.10's
CPU back end was measured to: per-pair FIFO order, message boundaries kept, a message delivered
into a larger buffer (the rest untouched), a too-small buffer fails with "Recv failed." and the
message is consumed. So these tests check the protocol logic in seconds; the multi-rank test
``tests/multirank/test_transport_steady.py`` checks the same behaviour over real messages.

Every test runs on both frame realisations (:mod:`graph_exec.transport.frame_memory`): host
frames (the CPU fast path) over a fake that writes a received message into the memory behind the
receiving tensor, as MindSpore's CPU back end does, and tensor frames (the device path) over that
fake and over one that behaves like a device: the received bytes replace the tensor's data and
the numpy array the tensor may have been made from stays as it was, so code that reads received
data anywhere but through the tensor fails (shown by
:func:`test_host_reads_fail_where_the_received_memory_is_not_host_memory`).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import mindspore as ms
import numpy as np
import pytest

import graph_exec.transport.comm as comm
from graph_exec.errors import (
    PeerTimeoutError,
    ProtocolError,
    RemoteRankError,
    StepTagMismatchError,
    silent_peers,
)
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport.frame_memory import HostFrames, TensorFrames, numpy_allocator, tensor_allocator
from graph_exec.transport.meta import CONTROL_BYTES
from graph_exec.transport.p2p import PublicPointToPoint

prepare_mindspore("CPU")


class _Done:
    def wait(self) -> None:
        return None


class FakeLink:
    """Two ranks' ordered channels, with the CPU back end's observed receive semantics.

    ``device_like``: a receive replaces the receiving tensor's data (``Tensor.assign_value``)
    instead of writing the memory behind it, as on a device whose memory is not host memory.
    """

    def __init__(self, device_like: bool = False) -> None:
        self.queues: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)
        self.block_s = 0.0  # how long a receive waits for a message from another thread
        #: A receive from a silent peer fails as the back end does at its limit ("Recv failed."),
        #: rather than as a test error.
        self.silent_fails = False
        self.device_like = device_like

    def endpoint(self, rank: int) -> FakeDist:
        return FakeDist(self, rank)


class FakeDist:
    def __init__(self, link: FakeLink, rank: int) -> None:
        self.link, self.rank = link, rank

    def isend(self, tensor, dst, group=None):
        self.link.queues[(self.rank, dst)].append(tensor.asnumpy().tobytes())
        return _Done()

    def recv(self, tensor, src, group=None):
        queue = self.link.queues[(src, self.rank)]
        deadline = time.monotonic() + self.link.block_s
        while not queue:  # a peer on another thread may still send
            if time.monotonic() > deadline:
                if self.link.silent_fails:
                    raise RuntimeError("Recv failed.")
                raise AssertionError(f"rank {self.rank} would block: nothing from rank {src}")
            time.sleep(0.001)
        message = queue.popleft()
        if len(message) > tensor.nbytes:
            raise RuntimeError("Recv failed.")
        if self.link.device_like:
            values = tensor.asnumpy().reshape(-1).view(np.uint8).copy()
            values[: len(message)] = np.frombuffer(message, np.uint8)
            tensor.assign_value(ms.Tensor(values.view(tensor.asnumpy().dtype).reshape(tensor.shape)))
            return
        target = tensor.asnumpy().reshape(-1).view(np.uint8)
        target[: len(message)] = np.frombuffer(message, np.uint8)


#: (frame realisation, fake semantics) of every protocol test.
REALISATIONS = {
    "host-frames": (HostFrames, False),
    "tensor-frames": (TensorFrames, False),
    "tensor-frames-device-like": (TensorFrames, True),
}


def make_pair(monkeypatch, frames, device_like):
    """Transports for ranks 0 and 1 of a 2-rank world, joined by a :class:`FakeLink`, with frames
    of the class ``frames`` and the send completion of the path that uses them."""
    import mindspore.mint.distributed as dist

    monkeypatch.setattr(comm, "require_initialized", lambda: None)
    monkeypatch.setattr(comm, "rebind_default_groups", lambda: None)
    monkeypatch.setattr(comm, "_workers", {})
    monkeypatch.setattr(comm._exit_barrier, "track", lambda transport: None)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    link = FakeLink(device_like)
    transports = []
    for rank in (0, 1):  # each rank's process counts its own transports: both are epoch 0
        monkeypatch.setattr(comm, "_epochs", {})
        monkeypatch.setattr(dist, "get_rank", lambda *a, rank=rank, **k: rank)
        transport = comm.Transport(timeout_s=10.0)
        transport._dist = link.endpoint(rank)
        transport._p2p = PublicPointToPoint(transport._dist, "fake", (0, 1))
        transport.frames = frames(transport.epoch)
        transport._sends_complete_on_post = frames is HostFrames
        transports.append(transport)
    return transports[0], transports[1], link


@pytest.fixture(params=list(REALISATIONS))
def pair(request, monkeypatch):
    """A pair of transports (see :func:`make_pair`) in each realisation."""
    return make_pair(monkeypatch, *REALISATIONS[request.param])


def as_restarted(transport, epoch):
    """Make ``transport`` what a new transport of ``epoch`` on the same ranks starts as."""
    transport.epoch = epoch
    transport._outbound = [comm._Outbound() for _ in range(2)]
    transport._inbound = [comm._Inbound() for _ in range(2)]
    transport.frames = type(transport.frames)(epoch)


def tensor(values, dtype=np.float32):
    return ms.from_numpy(np.array(values, dtype=dtype))


def test_a_layout_is_announced_once_then_frames_travel_alone(pair):
    a, b, _ = pair
    for step in range(4):
        group = (tensor(np.arange(12).reshape(3, 4) + step), None, tensor([step, 1], np.int32))
        a.send(group, 1, "Fsend0.0")
        got = b.recv(0, "Fsend0.0")
        assert got[1] is None and got[0].shape == (3, 4)
        assert np.array_equal(got[0].asnumpy(), np.arange(12).reshape(3, 4) + step)
        assert np.array_equal(got[2].asnumpy(), [step, 1])
    assert (a.stats.headers_sent, b.stats.headers_received) == (1, 1)
    assert (a.stats.messages_sent, b.stats.messages_received) == (5, 5)  # 1 header + 4 frames


def test_shape_changes_are_announced_and_delivered(pair):
    a, b, _ = pair
    for rows, cols in [(2, 8), (4, 8), (8, 4), (1, 2), (1, 2)]:  # larger, same bytes transposed, smaller
        values = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
        a.send((tensor(values),), 1, "Bsend1.0")
        assert np.array_equal(b.recv(0, "Bsend1.0")[0].asnumpy(), values)
    assert b.stats.headers_received == 4


def test_bfloat16_scalars_and_empty_tensors_keep_dtype_and_shape(pair):
    a, b, _ = pair
    group = (tensor([1.5, -2.0]).astype(ms.bfloat16), tensor(3.25), tensor(np.zeros((0, 3))))
    for _ in range(2):
        a.send(group, 1, "OUTsend2")
        got = b.recv(0, "OUTsend2")
        assert got[0].dtype == ms.bfloat16 and np.array_equal(got[0].float().asnumpy(), [1.5, -2.0])
        assert got[1].shape == () and float(got[1].asnumpy()) == 3.25
        assert got[2].shape == (0, 3)


def test_views_transposes_and_fresh_results_travel_with_their_values(pair):
    """The sender copies contiguous tensors from their address (a slice's includes its offset)
    and others through numpy; both must send the tensor's values, not its storage."""
    a, b, _ = pair
    base = tensor(np.arange(24).reshape(4, 6))
    cases = {
        "slice": (base[1:3], np.arange(24).reshape(4, 6)[1:3]),
        "transpose": (ms.ops.transpose(base, (1, 0)), np.arange(24).reshape(4, 6).T),
        "computed": (base * 2 + 1, np.arange(24).reshape(4, 6) * 2 + 1),
    }
    assert not cases["transpose"][0].is_contiguous() and cases["slice"][0].storage_offset() == 6
    for name, (value, expected) in cases.items():
        a.send((value,), 1, "Fsend0.0")
        assert np.array_equal(b.recv(0, "Fsend0.0")[0].asnumpy(), expected), name


def test_labels_alternating_on_one_layout_each_arrive_under_their_own_name(pair):
    a, b, _ = pair
    for step in range(3):
        for label in ("Fsend0.0", "Fsend0.1"):
            a.send((tensor([step, len(label)]),), 1, label)
            assert b.recv(0, label)[0].asnumpy().tolist() == [step, len(label)]
    a.send((tensor([0.0, 0.0]),), 1, "Fsend0.1")
    with pytest.raises(ProtocolError, match=r"expected Fsend0\.0 from rank 0 but received Fsend0\.1"):
        b.recv(0, "Fsend0.0")


def test_received_host_tensors_are_views_of_the_allocated_memory(monkeypatch):
    a, b, _ = make_pair(monkeypatch, HostFrames, device_like=False)
    given = []

    def alloc(nbytes):
        given.append(numpy_allocator(nbytes))
        return given[-1]

    for _ in range(2):
        a.send((tensor(np.ones(64)),), 1, "Fsend0.1")
        got = b.recv(0, "Fsend0.1", alloc)
        assert np.shares_memory(got[0].asnumpy(), given[-1])


def recording_allocator(receiver):
    """``(asked, alloc)``: ``receiver``'s frame allocator, noting in ``asked`` each size it is asked for."""
    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return receiver.frames.allocate(nbytes)

    return asked, alloc


def test_sender_and_receiver_name_the_same_message_sizes(pair):
    """NCCL and HCCL match a point-to-point message by its byte count: every message a receiver
    asks its allocator for has exactly the size of the message sent (small frames are padded to a
    control message, which an abort notice needs)."""
    a, b, link = pair
    asked, alloc = recording_allocator(b)

    for values in (np.ones(3), np.ones(3), np.ones((40, 40)), np.ones((40, 40))):
        a.send((tensor(values),), 1, "Fsend0.1")
        sent = [len(message) for message in link.queues[(0, 1)]]
        before = len(asked)
        b.recv(0, "Fsend0.1", alloc)
        assert asked[before:] == sent
    assert asked == [CONTROL_BYTES, CONTROL_BYTES, CONTROL_BYTES, CONTROL_BYTES, 6464, 6464]


def test_a_new_layout_after_a_large_frame_is_announced_at_the_size_the_receiver_posts(pair):
    """A receiver posts its next receive under a label at the size of the frame it last took
    there; a header announcing a new layout (shapes that change between steps, or ragged
    micro-batches placed in another order) is padded to that size, so it has exactly the byte
    count of the receive that takes it, whichever way the size changes."""
    a, b, link = pair
    asked, alloc = recording_allocator(b)

    for shape in ((40, 40), (3,), (50, 40), (40, 40), (40, 40)):
        values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        a.send((tensor(values),), 1, "Fsend0.1")
        sent = [len(message) for message in link.queues[(0, 1)]]
        before = len(asked)
        assert np.array_equal(b.recv(0, "Fsend0.1", alloc)[0].asnumpy(), values)
        assert asked[before:] == sent
    assert asked == [CONTROL_BYTES, 6464, 6464, CONTROL_BYTES, CONTROL_BYTES, 8064, 8064, 6464, 6464]
    assert b.stats.headers_received == 4


def test_host_reads_fail_where_the_received_memory_is_not_host_memory(monkeypatch):
    """The device-like fake catches a transport that reads received bytes through host memory:
    host frames (the CPU fast path, which does) fail over it, while the tensor frames pass every
    test above over the same fake. The receive memory starts zeroed here: memory fresh from numpy
    may still hold an earlier message, which a stale read would take for this one."""
    a, b, _ = make_pair(monkeypatch, HostFrames, device_like=True)
    a.send((tensor([1.0, 2.0]),), 1, "Fsend0.0")
    with pytest.raises(
        ProtocolError, match=r"expected Fsend0\.0 from rank 0 but received a message of kind 0x0"
    ):
        b.recv(0, "Fsend0.0", lambda nbytes: np.zeros(nbytes, np.uint8))


def test_tensor_frames_hold_their_values_in_fresh_device_tensors(monkeypatch):
    a, b, _ = make_pair(monkeypatch, TensorFrames, device_like=True)
    a.send((tensor([[1.5, 2.5]]), tensor([7, 8], np.int64)), 1, "Fsend0.0")
    got = b.recv(0, "Fsend0.0", tensor_allocator)
    assert got[0].dtype == ms.float32 and got[0].shape == (1, 2) and got[1].dtype == ms.int64
    assert got[0].asnumpy().tolist() == [[1.5, 2.5]] and got[1].asnumpy().tolist() == [7, 8]


@pytest.mark.parametrize("floats", [16, 20_000])
def test_each_received_group_keeps_its_values_while_later_ones_arrive(pair, floats):
    """A group received earlier must not change when the next transfer of the same layout
    arrives (each frame gets its own memory from the allocator)."""
    a, b, _ = pair
    got = []
    for step in range(3):
        a.send((tensor(np.full(floats, step)),), 1, "Fsend0.0")
        got.append(b.recv(0, "Fsend0.0")[0])
    for step, received in enumerate(got):
        assert np.array_equal(received.asnumpy(), np.full(floats, step, np.float32)), step


def test_mislabelled_header_names_both_labels_and_keeps_the_channel_in_order(pair):
    a, b, link = pair
    a.send((tensor([1.0]),), 1, "Fsend0.3")
    with pytest.raises(ProtocolError, match=r"expected Fsend0.2 from rank 0 but received Fsend0.3"):
        b.recv(0, "Fsend0.2")
    assert not link.queues[(0, 1)]  # its frame was taken too


def test_mislabelled_frame_in_steady_state_names_both_labels(pair):
    a, b, _ = pair
    for label in ("Fsend0.0", "Fsend0.1"):
        a.send((tensor([1.0, 2.0]),), 1, label)
        b.recv(0, label)
    a.send((tensor([1.0, 2.0]),), 1, "Fsend0.1")  # frame only: the layout is known on both sides
    with pytest.raises(ProtocolError, match=r"expected Fsend0.0 from rank 0 but received Fsend0.1"):
        b.recv(0, "Fsend0.0")


def test_a_frame_larger_than_the_posted_buffer_is_a_clear_error(pair):
    a, b, _ = pair
    for label, size in (("Fsend0.0", 4), ("Fsend0.1", 4096)):
        a.send((tensor(np.ones(size)),), 1, label)
        b.recv(0, label)
    a.send((tensor(np.ones(4096)),), 1, "Fsend0.1")
    with pytest.raises(ProtocolError, match=r"could not receive Fsend0.0 .* larger message"):
        b.recv(0, "Fsend0.0")


def test_a_silent_peer_is_a_time_out_naming_its_global_rank(pair, monkeypatch):
    """What a launcher reads from the log of a rank that waited in vain: the rank it waited for."""
    a, b, link = pair
    link.silent_fails = True
    monkeypatch.setattr(comm, "backend_wait_limit", lambda: 0.0)  # the back end gave up at its limit
    for waiting, silent in ((b, 0), (a, 1)):
        with pytest.raises(PeerTimeoutError, match=rf"\[waiting for global rank {silent}\]") as caught:
            waiting.recv(silent, "Fsend0.0")
        assert silent_peers(f"PipelineStepError: ...: PeerTimeoutError: {caught.value}") == {silent}


def test_a_lost_message_is_caught_by_the_sequence_number(pair):
    a, b, link = pair
    for step in range(3):
        a.send((tensor([float(step)]),), 1, "Fsend0.0")
    b.recv(0, "Fsend0.0")
    link.queues[(0, 1)].popleft()  # the second transfer is lost
    with pytest.raises(ProtocolError, match=r"transfer #2 of the pair where #1 was due"):
        b.recv(0, "Fsend0.0")


def test_a_step_tag_travels_with_every_transfer_and_a_different_one_is_refused(pair):
    """The tag rides in the sequence word: agreeing tags deliver (a first header and steady
    frames alike, tags changing between steps), a peer's other tag is refused, named."""
    a, b, _ = pair
    for step, tag in enumerate((0, 5, 5, (1 << 31) - 1)):
        a.set_step_tag(tag)
        b.set_step_tag(tag)
        a.send((tensor([float(step)]),), 1, "Fsend0.0")
        assert b.recv(0, "Fsend0.0")[0].asnumpy()[0] == float(step)
    assert a.stats.messages_sent == 5  # one header, then frames alone: the tag costs no message
    b.set_step_tag(7, lambda tag: f"placement #{tag}")
    for label in ("Fsend0.0", "Fsend0.1"):  # a steady frame and a first header
        a.send((tensor([1.0]),), 1, label)
        with pytest.raises(
            StepTagMismatchError, match=r"step with placement #7, but rank 0's step has placement #2147483647"
        ):
            b.recv(0, label)
        b.set_step_tag(7, lambda tag: f"placement #{tag}")
    with pytest.raises(ValueError, match=r"step tag is an integer in \[0, 2147483647\], got -1"):
        a.set_step_tag(-1)


def test_a_wait_bound_waits_on_the_callers_thread_only_where_the_back_end_ends_it(pair, monkeypatch):
    """A step's bound (:mod:`graph_exec.runtime.wait_bounds`): where the back end fails a wait at
    its limit (here 20 s) a longer bound can wait on the caller's thread, a shorter one needs the
    communication thread's deadline; transfers flow either way."""
    a, b, _ = pair
    monkeypatch.setattr(comm, "backend_ends_waits", lambda seconds: seconds >= 20)
    for bound, direct in ((30.0, a._sends_complete_on_post), (10.0, False)):
        a.set_wait_bound(bound)
        b.set_wait_bound(bound)
        assert (a.timeout_s, a.direct) == (bound, direct)
        a.send((tensor([bound]),), 1, "Fsend0.0")
        assert b.recv(0, "Fsend0.0")[0].asnumpy()[0] == bound
    with pytest.raises(ValueError, match="timeout_s"):
        a.set_wait_bound(0.0)


def test_a_layout_the_receiver_never_heard_of_is_refused(pair):
    a, b, link = pair
    a.send((tensor([1.0]),), 1, "Fsend0.0")
    link.queues[(0, 1)].popleft()  # the header is lost: the frame arrives alone
    with pytest.raises(ProtocolError, match="without the header"):
        b.recv(0, "Fsend0.0")


def test_an_abort_notice_reaches_a_rank_expecting_a_large_frame(pair):
    a, b, _ = pair
    a.send((tensor(np.ones((64, 64))),), 1, "Fsend0.0")
    b.recv(0, "Fsend0.0")
    a.abort("step F0.1 raised ValueError: boom", grace_s=0)
    with pytest.raises(RemoteRankError, match=r"rank 0 failed: rank 0: step F0.1 raised ValueError: boom"):
        b.recv(0, "Fsend0.0")


def test_a_message_from_another_transport_epoch_is_refused(pair):
    a, b, _ = pair
    as_restarted(b, 1)  # rank 1 restarted, rank 0 did not
    a.send((tensor([1.0]),), 1, "Fsend0.0")
    with pytest.raises(ProtocolError, match=r"epoch 0 \(this transport's is 1\)"):
        b.recv(0, "Fsend0.0")


def test_bad_input_fails_before_any_message(pair):
    a, _, link = pair
    with pytest.raises(ValueError, match="longer than 32 bytes"):
        a.send((tensor([1.0]),), 1, "L" * 40)
    with pytest.raises(ValueError, match="cannot be sent"):
        a.send((tensor([1.0], np.complex64),), 1, "Fsend0.0")
    assert not link.queues[(0, 1)]


def test_a_restart_skips_what_the_failed_step_left_then_exchanges_cleanly(pair):
    a, b, link = pair
    a.send((tensor(np.ones((64, 64))),), 1, "Fsend0.0")  # rank 1 never reads header and frame,
    a.abort("step B0.0 failed", grace_s=0)  # nor this notice (rank 0 read rank 1's)
    for transport in (a, b):  # both ranks build their next transport on the same group
        as_restarted(transport, 1)
    link.block_s = 5.0
    threads = [threading.Thread(target=t._resync) for t in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert (a.stats.stale_skipped, b.stats.stale_skipped) == (0, 3)  # one of them larger than a hello
    link.block_s = 0.0
    a.send((tensor([7.0]),), 1, "Fsend0.0")
    assert float(b.recv(0, "Fsend0.0")[0].asnumpy()[0]) == 7.0


def test_the_exit_barrier_is_skipped_after_an_abort(pair, monkeypatch):
    """A rank that gave up on a step must not join a collective at exit: a peer may still sit in
    ``GRADreduce``, and the barrier would complete that all-reduce with wrong data."""
    a, _, _ = pair
    barriers = []
    monkeypatch.setattr(comm, "world_barrier", lambda dist, group: barriers.append(group))
    exit_barrier = comm._ExitBarrier()
    exit_barrier.latest = a
    exit_barrier()
    assert len(barriers) == 1
    a.abort("step B0.1 raised ValueError: boom", grace_s=0.0)
    exit_barrier()
    assert len(barriers) == 1
