"""Header-free transfers on 2 ranks; prints ``CHECK <name> OK`` per passed check.

One job, in order: steady-state steps (one message per transfer, no header after the first
step), shapes that change between steps, mislabelled messages (same size, and larger than
expected), then a step aborted with messages left in the channel, followed by a restart (a new
transport on the same ranks) that exchanges correctly again.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.communication import init

from graph_exec.errors import ProtocolError, RemoteRankError
from graph_exec.msenv import prepare_mindspore
from graph_exec.transport import Transport
from tests.models.common import announce_policy

prepare_mindspore("CPU")

announce_policy()
init()
tp = Transport(timeout_s=60.0)
rank = tp.rank


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise AssertionError(f"check {name} failed on rank {rank}: {detail}")
    print(f"CHECK {name} OK", flush=True)


def forward_group(step: int, rows: int = 4, cols: int = 8) -> tuple:
    """What rank 0 sends in a step: float32 activations, a None entry, int32 ids."""
    base = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 100 * step
    return Tensor(base), None, Tensor(np.arange(3, dtype=np.int32) + step)


def backward_group(got: tuple) -> tuple:
    """What rank 1 answers: the activations doubled, and as bfloat16."""
    doubled = got[0].asnumpy() * 2
    return Tensor(doubled), Tensor(doubled).astype(ms.bfloat16)


def exchange(transport: Transport, step: int, rows: int = 4, cols: int = 8) -> None:
    """One step: F from rank 0 to 1, B back; both sides check the values and shapes."""
    sent = forward_group(step, rows, cols)
    if rank == 0:
        transport.send(sent, 1, "Fsend0.0")
        back = transport.recv(1, "Bsend1.0")
        expect = sent[0].asnumpy() * 2
        ok = np.array_equal(back[0].asnumpy(), expect) and back[0].shape == (rows, cols)
        ok = (
            ok
            and back[1].dtype == ms.bfloat16
            and np.array_equal(
                back[1].float().asnumpy(), Tensor(expect).astype(ms.bfloat16).float().asnumpy()
            )
        )
        check(f"values_back_{step}", ok, back)
    else:
        got = transport.recv(0, "Fsend0.0")
        ok = (
            got[1] is None
            and got[0].shape == (rows, cols)
            and np.array_equal(got[0].asnumpy(), sent[0].asnumpy())
        )
        check(f"values_forward_{step}", ok and np.array_equal(got[2].asnumpy(), sent[2].asnumpy()), got)
        transport.send(backward_group(got), 0, "Bsend1.0")


# 1. Steady state: the first step announces each layout once, later steps send frames only.
exchange(tp, 0)
headers, sent, received = tp.stats.headers_sent, tp.stats.messages_sent, tp.stats.messages_received
check("first_step_has_headers", headers == 1 and tp.stats.headers_received == 1, tp.stats)
for step in range(1, 4):
    exchange(tp, step)
check(
    "steady_state_header_free",
    tp.stats.headers_sent == headers
    and tp.stats.messages_sent - sent == 3
    and tp.stats.messages_received - received == 3,
    tp.stats,
)

# 2. Shapes change between steps: more rows (a larger frame), the same bytes transposed
# (only the layout digest differs), fewer rows, then back: each change is announced once.
for step, (rows, cols) in enumerate([(6, 8), (8, 4), (2, 8), (4, 8), (4, 8)], start=4):
    exchange(tp, step, rows, cols)
check("shape_changes_announced", tp.stats.headers_sent == headers + 4, tp.stats)

# 3. Mislabelled messages still fail loudly, naming both labels: a header (a label new to the
# pair), a data frame alone (a label whose layout both sides know), and a frame larger than the
# buffer the receiver posted.
big = (Tensor(np.zeros((64, 64), np.float32)),)
if rank == 0:
    tp.send(big, 1, "Fsend0.2")
    tp.send(forward_group(9), 1, "Fsend0.1")
    tp.send(forward_group(9), 1, "Fsend0.0")
    tp.send(big, 1, "Fsend0.2")
else:
    check("announced_big", tp.recv(0, "Fsend0.2")[0].shape == (64, 64))
    for name, expect, wrong in (
        ("mislabelled_header", "Fsend0.0", "Fsend0.1"),
        ("mislabelled_frame", "Fsend0.1", "Fsend0.0"),
    ):
        try:
            tp.recv(0, expect)
            check(name, False, "no error")
        except ProtocolError as exc:
            check(name, f"expected {expect} from rank 0 but received {wrong}" in str(exc), exc)
    try:
        tp.recv(0, "Fsend0.0")
        check("oversized_frame", False, "no error")
    except ProtocolError as exc:
        check("oversized_frame", "Fsend0.0" in str(exc) and "larger message" in str(exc), exc)

# 4. A step aborted with messages left in the channel, then a restart on the same ranks.
if rank == 0:
    tp.send((Tensor(np.ones((128, 128), np.float32)),), 1, "Fsend0.3")  # rank 1 never reads it
    try:
        tp.recv(1, "Bsend1.3")
        check("abort_reported", False, "no error")
    except RemoteRankError as exc:
        check("abort_reported", "rank 1" in str(exc) and "injected" in str(exc), exc)
    tp.abort("step Bsend1.3 failed", grace_s=0.5)  # as the driver does: rank 1 never reads this
else:
    tp.abort("step F1.3 raised RuntimeError: injected", grace_s=0.5)
tp = Transport(timeout_s=60.0)
check("restart_epoch", tp.epoch == 1, tp.epoch)
# Rank 1 never read rank 0's header, 64 KiB frame and abort notice; rank 0 read rank 1's notice.
check("stale_skipped", tp.stats.stale_skipped == (3 if rank == 1 else 0), tp.stats)
flags = Tensor(np.full(2, float(rank + 1), np.float32))
tp.all_reduce_sum([flags])
check("collective_after_restart", np.array_equal(flags.asnumpy(), np.full(2, 3.0, np.float32)), flags)
for step in range(20, 23):
    exchange(tp, step)
check("restart_exchanges", tp.stats.headers_sent == 1 and tp.stats.messages_sent == 4, tp.stats)
