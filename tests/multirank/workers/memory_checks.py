"""``stats()["memory"]`` on 2 real ranks against counts and bytes derived by hand.

The tiny model of tests/models/pipeline.py, 2 stages (V = 1), 4 micro-batches of 2 rows,
float32. Interleaved 1F1B with V = 1 warms up 2 (P - r - 1) forwards, so rank 0 holds 3
micro-batches of stage 0 at its peak; rank 1's last stage holds only its fused step's input.
Bytes per micro-batch: raw features [2, 6] = 48, a hidden [2, 8] = 64, the projector's two
outputs 2 x 64 = 128. A taped forward keeps its inputs and outputs, a recomputed one its
inputs; a received message is a frame of at least ``CONTROL_BYTES``. Every figure is checked
after the second step (steady-state messages carry no header).
"""

from __future__ import annotations

import mindspore as ms
from mindspore.communication import get_rank, init

import graph_exec as ge
from graph_exec.msenv import prepare_mindspore
from graph_exec.schedule.memory import peak_counts
from graph_exec.transport.frames import PREFIX_BYTES
from graph_exec.transport.meta import CONTROL_BYTES
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build

prepare_mindspore("CPU")
announce_policy()
init()
rank = get_rank()
failures = 0


def check(name: str, ok: bool, detail: object = "") -> None:
    global failures
    print(f"CHECK {name} {'OK' if ok else f'FAIL {detail}'}", flush=True)
    failures += not ok


def memory_after_two_steps(preprocess: str, mpipe: bool, recompute: bool):
    model = build(2, preprocess)
    stage = ge.PipelineStage(model.stages[rank], rank, 2)
    layers = 0 if model.preprocess is None else 1
    kind = ge.ScheduleMPipeTranspose if mpipe else ge.ScheduleInterleaved1F1B
    sched = kind(stage, 4, model.preprocess, layers, loss_fn=loss_fn, recompute=recompute)
    for seed in (1, 2):
        x, labels = batch(8, seed=seed)
        sched.run(x, labels=labels)
        sched.step(ms.nn.SGD(sched.trainable_params(), learning_rate=0.01))
    return sched, sched.stats()["memory"]


for name, preprocess, mpipe, recompute, stage0 in [
    ("i1f1b_taped", "none", False, False, 48 + 64),
    ("i1f1b_recompute", "none", False, True, 48),
    ("mpipe_frozen", "frozen", True, False, 128 + 64),
]:
    sched, memory = memory_after_two_steps(preprocess, mpipe, recompute)
    per_micro, held = ({0: stage0}, 3 * stage0) if rank == 0 else ({1: 64}, 64)
    check(f"{name}.per_micro", memory["activation_bytes_per_micro"] == per_micro, memory)
    check(f"{name}.activations", memory["activations"] == held, f"{memory['activations']} != {held}")
    counts = peak_counts(sched.plan, rank)
    # A receive slot holds a whole frame: a prefix and each tensor at a 64-byte aligned offset,
    # at least a control message's size. Every message here (one or two [2, 8] float32 tensors)
    # is below that floor, so each slot holds CONTROL_BYTES.
    assert PREFIX_BYTES + 2 * 64 <= CONTROL_BYTES
    want = counts["receives"] * CONTROL_BYTES
    check(f"{name}.receives", memory["receive_slots"] == want, f"{memory['receive_slots']} != {want}")
    want = counts["preprocess outputs"] * 128
    check(
        f"{name}.preprocess_outputs",
        memory["preprocess_outputs"] == want and (want > 0) == mpipe,
        f"{memory['preprocess_outputs']} != {want}",
    )
    check(f"{name}.rss", memory["peak_rss"] > 100 * 2**20 and memory["allocator_peak"] is None, memory)

print(f"ALL DONE failures={failures}", flush=True)
