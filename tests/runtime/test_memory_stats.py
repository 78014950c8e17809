"""``stats()["memory"]`` on one process (P = 1, three stages local), against figures derived by
hand from the tiny model's shapes and against the schedule's memory model.

The tiny model (tests/models/pipeline.py), 8 rows in 4 micro-batches of 2, float32: the
preprocess makes two [2, 8] tensors (128 bytes), stage 0 reads them and makes one [2, 8]
(64 bytes), stage 1 reads 64 and makes 64, the last stage reads 64.
"""

import pytest
from mindspore import nn

import graph_exec as ge
from graph_exec.schedule.memory import ItemSizes, peak_bytes
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build


def run_once(preprocess: str, recompute: bool):
    model = build(3, preprocess)
    stages = [ge.PipelineStage(cell, k, 3) for k, cell in enumerate(model.stages)]
    layers = 0 if model.preprocess is None else 1
    sched = ge.ScheduleMPipeTranspose(
        stages, 4, model.preprocess, layers, loss_fn=loss_fn, recompute=recompute
    )
    x, labels = batch(8)
    sched.run(x, labels=labels)
    return sched


@pytest.mark.parametrize(
    ("recompute", "per_micro", "peak"),
    # taped: inputs + outputs; recompute: inputs only. The peak is at B 0.0: stage 0 holds
    # micro-batches 0 and 1, stage 1 micro-batch 1 (order F0.0 F1.0 F2.0 B2.0 F0.1 B1.0 F1.1 B0.0).
    [(False, {0: 192, 1: 128, 2: 64}, 2 * 192 + 128), (True, {0: 128, 1: 64, 2: 64}, 2 * 128 + 64)],
)
def test_held_activations_match_the_hand_derived_bytes_and_the_model(recompute, per_micro, peak):
    sched = run_once("trainable", recompute)
    memory = sched.stats()["memory"]
    assert memory["activation_bytes_per_micro"] == per_micro
    assert memory["activations"] == peak
    sizes = ItemSizes(activations=per_micro, stage_inputs={})
    assert peak_bytes(sched.plan, 0, sizes) == peak
    # Rank 0 of a one-rank plan runs every TFWD first: 4 outputs of 128 bytes until F 0.m.
    assert memory["preprocess_outputs"] == 4 * 128
    assert memory["receive_slots"] == 0  # nothing is received on one rank
    assert memory["held_peak"] >= memory["activations"]


def test_parameters_accumulators_and_optimizer_state():
    sched = run_once("frozen", False)
    memory = sched.stats()["memory"]
    # Projector 2 x Dense(6, 8): 2 x 56 floats; stage 0 Dense(8, 8): 72; Hidden 72; Head Dense(8, 3): 27.
    frozen, trained = 2 * 56 * 4, (72 + 72 + 27) * 4
    assert memory["parameters"] == frozen + trained
    assert memory["gradient_accumulators"] == trained  # the frozen preprocess has none
    assert memory["optimizer_state"] is None  # no step() yet: the library has seen no optimizer
    sched.step(nn.Adam(sched.trainable_params()))
    # Adam: two moments per trained parameter, plus global_step (int32 [1]), beta1/beta2 powers
    # and the learning rate (float32 scalars).
    assert sched.stats()["memory"]["optimizer_state"] == 2 * trained + 4 + 3 * 4
    assert memory["peak_rss"] > 100 * 2**20 and memory["allocator_peak"] is None  # CPU


def test_the_caches_show_what_they_keep_and_their_bounds(cpu_path):
    """One process receives nothing, so only the kernel cache fills: over 20 batch sizes (one
    new signature per stage and step) it keeps its 4 entries and evicts the rest; the buffer
    caches report their bound (``buffer_cache_bytes``) and nothing kept."""
    model = build(3, "none")
    stages = [ge.PipelineStage(cell, k, 3) for k, cell in enumerate(model.stages)]
    sched = ge.ScheduleInterleaved1F1B(
        stages, 2, loss_fn=loss_fn, mode="pynative", kernel_cache_size=4, buffer_cache_bytes=4096
    )
    entries = []
    for rows in range(2, 42, 2):
        x, labels = batch(rows)
        sched.run(x, labels=labels)
        caches = sched.stats()["memory"]["caches"]
        entries.append(caches["kernels"]["entries"])
    assert max(entries) == 4 and entries[-1] == 4
    assert caches["kernels"]["max_entries"] == 4 and caches["kernels"]["evictions"] > 20
    assert caches["kernels"]["bytes"] == 0  # no kernel of the plain body holds tensors of its own
    assert caches["send_frames"] is None  # no transport on one rank
    assert caches["receive_slots"] == {
        "entries": 0,
        "bytes": 0,
        "max_bytes": 4096,
        "evictions": 0,
        "evicted_bytes": 0,
    }
