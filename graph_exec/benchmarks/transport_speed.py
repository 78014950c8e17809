"""Cost of the transport over raw MindSpore messages, measured side by side on 2 ranks.

``python -m graph_exec.benchmarks.transport_speed`` launches itself under msrun (2 local
ranks) and times ping-pong round trips of a one-tensor group, per payload size: once through
:class:`graph_exec.transport.Transport` (header + payload, label check, deadline) and once
with bare ``mindspore.mint.distributed`` ``isend``/``recv`` of the payload alone, in
alternating rounds. It prints both medians and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

SIZES = (1 << 10, 64 << 10, 1 << 20, 4 << 20)
ROUNDS, REPEATS = 5, 20


def _worker() -> None:
    import mindspore as ms
    import mindspore.mint.distributed as dist
    import numpy as np
    from mindspore.communication import init

    from graph_exec.msenv import prepare_mindspore
    from graph_exec.transport import Transport

    prepare_mindspore("CPU")
    init()
    tp = Transport(timeout_s=60)
    rank, peer = tp.rank, 1 - tp.rank

    def via_transport(tensor):
        if rank == 0:
            tp.send((tensor,), 1, "Fsend0.0")
            tp.recv(1, "Bsend1.0")
        else:
            got = tp.recv(0, "Fsend0.0")
            tp.send(got, 0, "Bsend1.0")
        tp.drain()

    def raw(tensor):
        buf = ms.from_numpy(np.empty(tensor.shape, np.float32))
        if rank == 0:
            dist.isend(tensor, dst=peer).wait()
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.isend(buf, dst=peer).wait()

    for nbytes in SIZES:
        tensor = ms.from_numpy(np.ones(nbytes // 4, np.float32))
        times: dict[str, list[float]] = {"transport": [], "raw": []}
        for _ in range(ROUNDS):
            for name, fn in (("transport", via_transport), ("raw", raw)):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(REPEATS):
                    fn(tensor)
                times[name].append((time.perf_counter() - start) / REPEATS)
        if rank == 0:
            ours, bare = statistics.median(times["transport"]), statistics.median(times["raw"])
            print(
                f"RESULT {nbytes >> 10:>6} KiB  transport {ours * 1e3:7.3f} ms  raw {bare * 1e3:7.3f} ms  "
                f"ratio {ours / bare:5.2f}  (round trip, median of {ROUNDS} rounds x {REPEATS})",
                flush=True,
            )
    dist.barrier()  # a rank must not exit while its peer still waits for a message's acknowledgement


def main() -> int:
    from graph_exec.launch import launch

    with tempfile.TemporaryDirectory() as logs:
        result = launch(__file__, ["worker"], nproc=2, log_dir=logs, timeout_s=600)
        if not result.ok:
            print(result.describe(), file=sys.stderr)
            return 1
        print("transport vs raw mindspore.mint.distributed, 2 ranks on loopback:")
        for line in result.worker_logs[0].splitlines():
            if line.startswith("RESULT "):
                print(line[len("RESULT ") :])
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        _worker()
    else:
        sys.exit(main())
