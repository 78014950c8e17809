"""Transport checks on 2 ranks; prints ``CHECK <name> OK`` or ``CHECK <name> FAIL <detail>``.

Scenario (argv[1]): ``basic`` runs the exchange checks and ends with an abort notice from
rank 1; ``stuck`` has rank 1 go silent for longer than rank 0's time-out (argv[2]), so rank 0
must time out — not earlier than the time-out, and not much later (it says whether the wait ran
on the caller's thread, ended by the back end, or on the communication thread); ``slow`` has rank 1 send
only after 38 s, longer than MindSpore's default 30 s limit on a CPU receive, which rank 0's
longer time-out (argv[2]) must outlast. Exits 1 if a check failed.
"""

import sys
import time

import numpy as np
from mindspore import Parameter, Tensor
from mindspore.communication import init

from graph_exec.errors import PeerTimeoutError, ProtocolError, RemoteRankError
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport import Transport
from graph_exec.transport.frame_memory import HostFrames
from tests.models.common import announce_policy

prepare_mindspore("CPU")

announce_policy()
init()
scenario = sys.argv[1]
tp = Transport(timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
rank, peer = tp.rank, 1 - tp.rank


failures = 0


def check(name: str, ok: bool, detail: object = "") -> None:
    global failures
    failures += not ok
    print(f"CHECK {name} {'OK' if ok else f'FAIL {detail}'}", flush=True)


if scenario == "basic":
    # A group with mixed dtypes, a None entry, a 0-d tensor and an empty tensor.
    group = (
        Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)),
        None,
        Tensor(np.array([5, 6, 7], np.int32)),
        Tensor(np.float32(2.5)),
        Tensor(np.zeros((0, 3), np.float32)),
    )
    if rank == 0:
        tp.send(group, dst=1, label="Fsend0.0")
        received = tp.recv(1, expect="Bsend1.0")
        check("roundtrip", np.array_equal(received[0].asnumpy(), group[0].asnumpy() * 2))
    else:
        backing: list[np.ndarray] = []

        def into_numpy(nbytes):
            arr = np.empty(nbytes, dtype=np.uint8)
            backing.append(arr)
            return arr

        host_frames = isinstance(tp.frames, HostFrames)  # the CPU fast path: frames in host memory
        got = tp.recv(0, expect="Fsend0.0", alloc=into_numpy if host_frames else None)
        check("none_kept", got[1] is None and len(got) == 5)
        check(
            "values",
            all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(got[::2], group[::2], strict=True)),
        )
        check(
            "dtypes",
            [str(t.dtype) for t in got if t is not None] == ["Float32", "Int32", "Float32", "Float32"],
        )
        check("scalar", got[3].shape == () and float(got[3].asnumpy()) == 2.5)
        if host_frames:
            check(
                "zero_copy",
                all(np.shares_memory(t.asnumpy(), backing[-1]) for t in got if t is not None and t.size),
            )
        tp.send((Tensor(got[0].asnumpy() * 2),), dst=0, label="Bsend1.0")

    # A label the receiver does not expect is a ProtocolError, not silent corruption.
    if rank == 0:
        tp.send((), dst=1, label="OUTsend3")
    else:
        try:
            tp.recv(0, expect="OUTsend1")
            check("label_mismatch", False)
        except ProtocolError as exc:
            check("label_mismatch", "OUTsend1" in str(exc) and "OUTsend3" in str(exc), exc)

    # Collectives act in place, on Parameters too.
    weight = Parameter(Tensor(np.full(4, float(rank + 1), np.float32)), name="w")
    tp.broadcast([weight], src=0)
    check("broadcast_param", np.array_equal(weight.asnumpy(), np.ones(4, np.float32)))
    acc = Parameter(Tensor(np.full(3, float(rank + 1), np.float32)), name="gacc.w")
    tp.all_reduce_sum([acc])
    check("all_reduce_param", np.array_equal(acc.asnumpy(), np.full(3, 3.0, np.float32)))
    check("stats", tp.stats.messages_sent > 0 and tp.stats.bytes_received > 0)

    # A failing rank tells its peer why; the peer reports that instead of waiting.
    if rank == 1:
        tp.abort("step F1.3 raised ValueError: boom", grace_s=3.0)
        print("CHECK abort_sent OK", flush=True)
    else:
        start = time.monotonic()
        try:
            tp.recv(1, expect="Bsend1.1")
            check("remote_error", False, "no error")
        except RemoteRankError as exc:
            waited = time.monotonic() - start
            check(
                "remote_error",
                "rank 1" in str(exc) and "F1.3" in str(exc) and waited < 30,
                f"{waited:.1f} s: {exc}",
            )

elif scenario == "stuck":
    check("waits_on_the_callers_thread" if tp.direct else "waits_on_the_comm_thread", True)
    if rank == 1:
        time.sleep(tp.timeout_s + 5)  # silent well past rank 0's time-out, then exits cleanly
        check("stayed_silent", True)
    else:
        start = time.monotonic()
        try:
            tp.recv(1, expect="Fsend0.0")
            check("timeout", False, "no error")
        except PeerTimeoutError as exc:
            waited = time.monotonic() - start
            check(
                "timeout",
                "Fsend0.0" in str(exc) and "rank 1" in str(exc) and tp.timeout_s <= waited < tp.timeout_s + 2,
                f"after {waited:.2f} s (time-out {tp.timeout_s:g} s): {exc}",
            )
        print(f"rank 0 exiting after {time.monotonic() - start:.1f} s", flush=True)

elif scenario == "slow":
    late = Tensor(np.arange(6, dtype=np.float32))
    if rank == 1:
        time.sleep(38.0)
        tp.send((late,), dst=0, label="Fsend1.0")
        check("sent_late", True)
    else:
        start = time.monotonic()
        (got,) = tp.recv(1, expect="Fsend1.0")
        waited = time.monotonic() - start
        check(
            "waited_past_30s",
            waited > 34 and np.array_equal(got.asnumpy(), late.asnumpy()),
            f"{waited:.1f} s",
        )

sys.exit(int(failures > 0))
