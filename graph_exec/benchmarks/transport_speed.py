"""Cost of the transport over raw MindSpore messages, measured side by side on 2 ranks.

``python -m graph_exec.benchmarks.transport_speed`` launches itself under msrun (2 local
ranks) and times ping-pong round trips of a one-tensor group, per payload size: through
:class:`graph_exec.transport.Transport` in steady state (one data frame per transfer, label and
sequence checked in band, calls on the caller's thread where the back end keeps the deadline,
receive memory from a buffer pool as in a pipeline step) and with bare ``mindspore.mint.distributed``
``isend``/``recv`` of the payload into a preallocated tensor (what a user would write by hand),
and with the same bare exchange through the send and receive ops the transport calls
(:mod:`graph_exec.transport.p2p`, without ``mint.distributed``'s per-call checks), and with a
*floor*: those ops doing only what any transport that hands out fresh tensors must do (copy the
tensor into a frame; receive into fresh pool memory and wrap the payload as a tensor), in
alternating rounds so that machine noise hits all four alike. It prints p10/p50/p90 of the
per-round means and the transport's ratio to each bare exchange (medians), plus how many
messages and headers the transport sent per round trip. A last pass times the sends and
receives inside the transport, to show how much of a round trip is the transport's own Python
on rank 0 (the timing wrappers' own cost, about 1 µs per round trip, is counted in it).

With ``GRAPH_EXEC_CPU_FAST_PATHS=0`` the transport takes the device path
(:mod:`graph_exec.device`): frames are MindSpore tensors, receives land in reused receive
slots, MindSpore's dispatch is asynchronous; the floor, which copies by host address, is then
left out. Run it both ways to see what the CPU fast paths buy.
"""

from __future__ import annotations

import ctypes
import sys
import time

from graph_exec.benchmarks.common import CommTimed, argument_parser, launch_and_report, p10_p50_p90

SIZES = (1 << 10, 64 << 10, 1 << 20, 4 << 20)
ROUNDS, REPEATS = 15, 20


class _Exchanges:
    """The round trips compared, on one rank: through the :class:`Transport`, through bare
    ``mint.distributed``, through the transport's own p2p ops, and the floor any transport handing
    out fresh tensors must pay. Received memory comes from the receive slots a pipeline uses."""

    def __init__(self) -> None:
        from graph_exec.device import policy
        from graph_exec.runtime.buffers import receive_slots
        from graph_exec.transport import Transport

        self.tp = Transport(timeout_s=60)
        self.rank, self.peer = self.tp.rank, 1 - self.tp.rank
        self.ops = self.tp._p2p
        self.slots = receive_slots()  # what a pipeline's receives use on this path
        self.host_path = policy().host_memory_aliasing
        self.held: list = []

    def alloc(self, nbytes: int):
        slot, memory = self.slots.acquire(nbytes)
        self.held.append(slot)
        return memory

    def release_all(self) -> None:
        while self.held:
            self.slots.release(self.held.pop())

    @staticmethod
    def settle() -> None:
        """With asynchronous dispatch a bare exchange returns before it has run: wait, as the
        transport does, so that both sides time completed round trips."""
        from graph_exec.device import policy, wait_until_run

        if not policy().synchronous_dispatch:
            wait_until_run()

    def via_transport(self, tensor) -> None:
        if self.rank == 0:
            self.tp.send((tensor,), 1, "Fsend0.0")
            self.tp.recv(1, "Bsend1.0", self.alloc)
        else:
            got = self.tp.recv(0, "Fsend0.0", self.alloc)
            self.tp.send(got, 0, "Bsend1.0")
        self.release_all()

    def raw(self, tensor, buffer) -> None:
        import mindspore.mint.distributed as dist

        if self.rank == 0:
            dist.isend(tensor, dst=self.peer).wait()
            dist.recv(buffer, src=self.peer)
        else:
            dist.recv(buffer, src=self.peer)
            dist.isend(buffer, dst=self.peer).wait()
        self.settle()

    def raw_ops(self, tensor, buffer) -> None:
        if self.rank == 0:
            self.ops.isend(tensor, self.peer).wait()
            self.ops.recv(buffer, self.peer)
        else:
            self.ops.recv(buffer, self.peer)
            self.ops.isend(buffer, self.peer).wait()
        self.settle()

    def send_staged(self, tensor, frame, frame_tensor, nbytes: int) -> None:
        from graph_exec.transport.frames import PREFIX_BYTES

        ctypes.memmove(frame.ctypes.data + PREFIX_BYTES, tensor.data_ptr(), nbytes)
        self.ops.isend(frame_tensor, self.peer).wait()

    def receive_fresh(self, nbytes: int):
        import mindspore as ms
        import numpy as np

        from graph_exec.transport.frames import PREFIX_BYTES

        memory = self.alloc(nbytes + PREFIX_BYTES)
        self.ops.recv(ms.from_numpy(memory), self.peer)
        return ms.from_numpy(memory[PREFIX_BYTES:].view(np.float32))

    def floor(self, tensor, frame, frame_tensor, nbytes: int) -> None:
        """What any transport that hands out fresh tensors must do: copy into a frame, receive
        into fresh pool memory, wrap the payload as a tensor (no checks, no bookkeeping)."""
        if self.rank == 0:
            self.send_staged(tensor, frame, frame_tensor, nbytes)
            self.receive_fresh(nbytes)
        else:
            self.send_staged(self.receive_fresh(nbytes), frame, frame_tensor, nbytes)
        self.release_all()

    def variants(self, nbytes: int) -> tuple[object, list]:
        """The payload of ``nbytes`` and the ``(name, round trip)`` pairs timed with it."""
        import mindspore as ms
        import numpy as np

        from graph_exec.transport.frames import PREFIX_BYTES

        tensor = ms.from_numpy(np.ones(nbytes // 4, np.float32))
        buffer = ms.from_numpy(np.empty(nbytes // 4, np.float32))
        frame = np.zeros(nbytes + PREFIX_BYTES, np.uint8)
        frame_tensor = ms.from_numpy(frame)
        variants = [
            ("transport", self.via_transport),
            ("raw", lambda t: self.raw(t, buffer)),
            ("ops", lambda t: self.raw_ops(t, buffer)),
        ]
        if self.host_path:
            variants.append(("floor", lambda t: self.floor(t, frame, frame_tensor, nbytes)))
        return tensor, variants


def _round_trip_times(variants: list, tensor) -> dict[str, list[float]]:
    """Seconds a round trip, :data:`ROUNDS` samples of :data:`REPEATS` each, every sample after
    a barrier and the variants interleaved so machine noise hits them alike."""
    import mindspore.mint.distributed as dist

    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(ROUNDS):
        for name, fn in variants:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(REPEATS):
                fn(tensor)
            times[name].append((time.perf_counter() - start) / REPEATS)
    return times


def _own_python_seconds(ex: _Exchanges, tensor) -> float:
    """Seconds a transport round trip takes outside its p2p ops' ``isend``/``recv``."""
    import mindspore.mint.distributed as dist

    inside: dict[str, float] = {"isend": 0.0, "recv": 0.0}
    ex.tp._p2p = CommTimed(ex.ops, inside, tuple(inside))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ROUNDS * REPEATS):
        ex.via_transport(tensor)
    own = (time.perf_counter() - start - sum(inside.values())) / (ROUNDS * REPEATS)
    ex.tp._p2p = ex.ops
    return own


def _measure_size(ex: _Exchanges, nbytes: int) -> None:
    """Time every variant at ``nbytes``; rank 0 prints the line."""
    from graph_exec.device import policy

    tensor, variants = ex.variants(nbytes)
    ex.via_transport(tensor)  # the first transfer of a label carries its header
    sent, headers = ex.tp.stats.messages_sent, ex.tp.stats.headers_sent
    times = _round_trip_times(variants, tensor)
    per_trip = (ex.tp.stats.messages_sent - sent) / (ROUNDS * REPEATS)
    header_trips = ex.tp.stats.headers_sent - headers
    own = _own_python_seconds(ex, tensor)
    if ex.rank == 0:
        ours, bare, op = (p10_p50_p90(times[n]) for n in ("transport", "raw", "ops"))
        least = p10_p50_p90(times["floor"]) if ex.host_path else None
        floor_text = f"floor {_ms(least)} ms = {least[1] / bare[1]:4.2f}x raw  " if least else ""
        print(
            f"RESULT {nbytes >> 10:>6} KiB  [{policy().describe()}]  transport {_ms(ours)} ms  raw "
            f"{_ms(bare)} ms  ratio(p50) {ours[1] / bare[1]:5.2f}  raw ops ({type(ex.ops).__name__}) "
            f"{_ms(op)} ms  ratio(p50) {ours[1] / op[1]:5.2f}  {floor_text}"
            f"messages sent/round trip {per_trip:.1f}, headers {header_trips}; "
            f"rank 0's own Python {own * 1e6:.0f} us/round trip",
            flush=True,
        )


def _worker() -> None:
    """One of the two ranks: every size in :data:`SIZES` in turn."""
    import mindspore.mint.distributed as dist
    from mindspore.communication import init

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    ex = _Exchanges()
    for nbytes in SIZES:
        _measure_size(ex, nbytes)
    dist.barrier()  # a rank must not exit while its peer still waits for a message's acknowledgement


def _ms(seconds: tuple[float, float, float]) -> str:
    return "/".join(f"{t * 1e3:.3f}" for t in seconds)


def main(argv: list[str]) -> int:
    argument_parser(__doc__, "transport_speed").parse_args(argv)
    return launch_and_report(
        __file__,
        ["worker"],
        nproc=2,
        timeout_s=600,
        ranks=[0],
        heading=(
            "transport vs raw mindspore.mint.distributed, 2 ranks on loopback; round trip p10/p50/p90 "
            f"of {ROUNDS} rounds x {REPEATS} (rank 0's view, steady state):"
        ),
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        _worker()
    else:
        sys.exit(main(sys.argv[1:]))
