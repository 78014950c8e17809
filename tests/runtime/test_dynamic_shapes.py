"""``shapes="dynamic"`` on one process: batches of 4, 6, 8 and 6 rows, both schedules, every
kind of preprocess, against the non-pipelined reference (losses and every gradient, atol 1e-5,
rtol 1e-4); the multi-rank cases are in tests/multirank/test_shapes.py.

Graph mode with a preprocess once returned a wrong stage-0 bias gradient from the second batch
size on (every stage-0 weight gradient with a frozen preprocess): stage 0 takes the
preprocess's two outputs, and the dynamic-shape graph got them as one ``mindspore.mutable``
tuple, whose weight gradients MindSpore 2.10 gets wrong under the autograd tape
(``graph_exec/executors/dynamic_kernel.py``, ``docs/shapes.md``).
"""

import pytest

import graph_exec as ge
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build, reference
from tests.runtime.test_single_process import assert_matches

SIZES = (4, 6, 8, 6)
MICRO = 2


def dynamic_schedule(kind, model, mode):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    layers = 0 if model.preprocess is None else 1
    return kind(stages, MICRO, model.preprocess, layers, mode=mode, loss_fn=loss_fn, shapes="dynamic")


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen", "none"])
@pytest.mark.parametrize(
    "kind", [ge.ScheduleMPipeTranspose, ge.ScheduleInterleaved1F1B], ids=["mpipe", "baseline"]
)
def test_dynamic_shapes_match_the_reference_at_every_batch_size(kind, preprocess, mode):
    model, ref = build(2, preprocess), build(2, preprocess)
    sched = dynamic_schedule(kind, model, mode)
    compiled = []
    for step, size in enumerate(SIZES):
        x, labels = batch(size, seed=10 + step)
        sched.zero_grad()
        losses = sched.run(x, labels=labels)
        ref_losses, ref_grads = reference(ref, x, labels, MICRO)
        assert_matches(sched, losses, ref_losses, ref_grads)
        compiled.append(sched.stats()["mindspore_compilations"])
    if mode == "graph":  # the third size (8 rows) runs the graphs compiled for the second
        assert compiled[2] == compiled[1]
