"""``run(micro_batches=...)``: the step already cut, each micro-batch its own size, on one process.

The checks (``graph_exec.runtime.microbatch.given_micro_batches``): each bad input is refused
with a ``ValueError`` naming the micro-batch and the value, before anything runs, and leaves the
schedule usable. The numerics: micro-batches of different row counts (the simplest ragged
shape: dim 0) give each micro-batch's reference loss and the summed reference gradients
(atol 1e-5, rtol 1e-4), both schedules, graph and pynative, and ``evaluate()`` with and without
labels. Ragged Qwen2-VL batches: tests/runtime/test_vlm_batch.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mindspore import Tensor

import graph_exec as ge
from graph_exec.runtime.microbatch import given_micro_batches, split_batch
from graph_exec.runtime.shapes import ShapeBuckets
from tests.models.common import ATOL, RTOL, assert_matches, loss_fn
from tests.models.pipeline import FEATURES, batch, build, reference

MICRO = 2


def schedule(model, cls=ge.ScheduleMPipeTranspose, **options):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    options.setdefault("loss_fn", loss_fn)
    if cls is ge.ScheduleInterleaved1F1B:
        return cls(stages, MICRO, **options)
    return cls(stages, MICRO, model.preprocess, 1, **options)


def ragged(rows=(3, 5), seed=1):
    """Micro-batches of ``rows`` rows each: ``[((x,), labels), ...]`` as numpy arrays."""
    x, labels = batch(sum(rows), seed=seed)
    x, labels = x.asnumpy(), labels.asnumpy()
    edges = np.cumsum((0, *rows))
    return [((x[a:b],), labels[a:b]) for a, b in itertools.pairwise(edges)]


def per_micro_reference(ref, micro_batches):
    """Each micro-batch's reference loss, and the gradients of their sum."""
    losses, grads = [], {}
    for (x,), labels in micro_batches:
        (loss,), g = reference(ref, Tensor(x), Tensor(labels), 1)
        losses.append(loss)
        grads = {k: grads.get(k, 0) + v for k, v in g.items()}
    return losses, grads


@pytest.fixture(scope="module")
def model():
    return build(2, "trainable")


def x_and_y(rows):
    return (np.zeros((rows, FEATURES), np.float32),), np.zeros(rows, np.int32)


BAD = [
    ({"a": 1}, r"micro_batches must be a list of \(inputs, labels\) pairs, one per micro-batch, got dict"),
    ([x_and_y(2)], r"micro_batches has 1 entries but micro_batch_num=2: pass exactly 2"),
    ([x_and_y(2)] * 3, r"micro_batches has 3 entries but micro_batch_num=2"),
    ([x_and_y(2), 5], r"micro_batches\[1\] must be a pair \(inputs, labels\), got int 5"),
    (
        [x_and_y(2), (*x_and_y(2), None)],
        r"micro_batches\[1\] must be a pair \(inputs, labels\), got a tuple of 3",
    ),
    (
        [x_and_y(2), ((), np.zeros(2, np.int32))],
        r"micro_batches\[1\]: inputs must be a non-empty tuple of tensors, got a tuple of 0",
    ),
    (
        [x_and_y(2), (np.zeros((2, FEATURES), np.float32), np.zeros(2, np.int32))],
        r"micro_batches\[1\]: inputs must be a non-empty tuple of tensors, got ndarray",
    ),
    (
        [x_and_y(2), (x_and_y(3)[0], np.zeros(2, np.int32))],
        r"micro-batch 1 label 0 has batch size 2 but micro-batch 1 input 0 has 3: all must match on dim 0",
    ),
    (
        [x_and_y(2), ((*x_and_y(2)[0], np.zeros((2, 1), np.float32)), np.zeros(2, np.int32))],
        r"micro-batch 1 has 2 inputs but micro-batch 0 has 1: every micro-batch passes the same tensors",
    ),
    (
        [x_and_y(2), ((np.zeros((2, FEATURES), np.float64),), np.zeros(2, np.int32))],
        r"micro-batch 1 input 0 is Float64 of shape \[2, 6\] but micro-batch 0's is Float32 of shape \[2, 6\]",
    ),
    (
        [x_and_y(2), ((np.zeros((2, FEATURES, 1), np.float32),), np.zeros(2, np.int32))],
        r"micro-batch 1 input 0 is Float32 of shape \[2, 6, 1\] but micro-batch 0's is Float32 of shape \[2, 6\]",
    ),
    (
        [x_and_y(2), (x_and_y(2)[0], (np.zeros(2, np.int32),) * 2)],
        r"micro-batch 1 has 2 labels but micro-batch 0 has 1",
    ),
    (
        [x_and_y(2), (x_and_y(2)[0], None)],
        r"micro_batches\[1\] has labels None, but labels are required: this schedule has a loss_fn",
    ),
    (
        [x_and_y(2), ((np.zeros((0, FEATURES), np.float32),), np.zeros(0, np.int32))],
        r"micro-batch 1 is empty \(0 rows on dim 0 of micro-batch 1 input 0\): every micro-batch needs at least one row",
    ),
]


@pytest.mark.parametrize(("micro_batches", "message"), BAD, ids=range(len(BAD)))
def test_bad_micro_batches_are_named_before_anything_runs(model, micro_batches, message):
    assert FEATURES == 6  # the shapes in the messages above
    sched = schedule(model)
    with pytest.raises(ValueError, match=message):
        sched.run(micro_batches=micro_batches)
    assert sched._setup is None  # refused before setting anything up (so before any message)
    sched.run(micro_batches=ragged())  # and the schedule is still usable


def test_a_value_of_another_type_is_named_with_its_micro_batch(model):
    with pytest.raises(
        TypeError, match=r"micro-batch 1 input 0 must be a mindspore.Tensor or a numpy.ndarray, got list"
    ):
        schedule(model).run(micro_batches=[x_and_y(2), (([[0.0] * FEATURES] * 2,), np.zeros(2, np.int32))])


def test_labels_in_some_micro_batches_only_are_refused_by_evaluate(model):
    sched = schedule(model)
    with pytest.raises(
        ValueError,
        match=r"micro-batch 1 has no labels but micro-batch 0 has: pass labels in every micro-batch or in none",
    ):
        sched.evaluate(micro_batches=[x_and_y(2), (x_and_y(2)[0], None)])
    with pytest.raises(ValueError, match=r"micro-batch 0 has no labels but micro-batch 1 has"):
        sched.evaluate(micro_batches=[(x_and_y(2)[0], None), x_and_y(2)])


@pytest.mark.parametrize(
    ("call", "given"),
    [
        (lambda s, mb: s.run(np.zeros((2, FEATURES), np.float32), micro_batches=mb), "1 positional inputs"),
        (lambda s, mb: s.run(labels=np.zeros(4, np.int32), micro_batches=mb), "labels="),
        (
            lambda s, mb: s.evaluate(extra=np.zeros(4, np.float32), micro_batches=mb),
            r"keyword inputs \['extra'\]",
        ),
    ],
)
def test_micro_batches_with_other_data_is_refused(model, call, given):
    with pytest.raises(
        ValueError, match=rf"got micro_batches= and also {given}: pass the step's data one way"
    ):
        call(schedule(model), ragged())


def test_owned_input_is_refused_in_one_process_at_construction(model):
    """Owned input needs a peer rank: refused when the schedule is made, naming the alternative.
    ``run(micro_batches=...)`` with owned input is refused on two ranks
    (``tests/multirank/workers/owned_data_checks.py``, ``micro_batches_refused``)."""
    with pytest.raises(ValueError, match=r"input 'owned' needs a peer rank.*use input 'replicated'"):
        schedule(model, input="owned")


def test_equal_micro_batches_are_what_split_batch_makes():
    """The same ``MicroBatches`` as cutting the whole batch: the runtime sees no difference."""
    x, labels = batch(4)
    cut = split_batch((x,), {}, labels, MICRO)
    given = given_micro_batches([((x[:2],), labels[:2]), ((x[2:],), labels[2:])], MICRO, labels_required=True)
    assert given.kwargs == cut.kwargs == ({}, {})
    for a, b in zip((*given.inputs, *given.labels), (*cut.inputs, *cut.labels), strict=True):
        np.testing.assert_array_equal(a[0].asnumpy(), b[0].asnumpy())
    assert given_micro_batches([((x,), None)], 1, labels_required=False).labels is None


def test_buckets_pad_each_micro_batch_to_its_own_bucket():
    buckets = ShapeBuckets(((1, (4, 8)),))
    short, long = np.ones((2, 3), np.int32), np.ones((2, 7), np.int32)
    given = given_micro_batches(
        [((short,), short), ((long,), long)], MICRO, labels_required=True, pad=buckets.pad
    )
    assert [t[0].shape for t in given.inputs] == [(2, 4), (2, 8)]
    (label0, mask0), (label1, mask1) = given.labels
    assert label0.shape == mask0.shape == (2, 4) and label1.shape == mask1.shape == (2, 8)
    assert mask0.asnumpy().sum(1).tolist() == [3, 3] and mask1.asnumpy().sum(1).tolist() == [7, 7]
    with pytest.raises(
        ValueError,
        match=r"micro_batches\[1\]: input 0 has length 9 on dim 1, above the largest shape bucket 8",
    ):
        given_micro_batches(
            [((short,), short), ((np.ones((2, 9), np.int32),), np.ones((2, 9), np.int32))],
            MICRO,
            labels_required=True,
            pad=buckets.pad,
        )


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("cls", [ge.ScheduleMPipeTranspose, ge.ScheduleInterleaved1F1B])
def test_micro_batches_of_different_sizes_match_each_ones_reference(mode, cls):
    """Micro-batches of 3 and 5 rows (then 6 and 2, then the first again): each loss is its
    micro-batch's reference loss, the gradients their sum; ``evaluate`` gives the same losses,
    and the last stage's outputs of each micro-batch without labels."""
    preprocess = "trainable" if cls is ge.ScheduleMPipeTranspose else "none"
    model, ref = build(2, preprocess), build(2, preprocess)
    sched = schedule(model, cls, mode=mode)
    for rows in ((3, 5), (6, 2), (3, 5)):
        micro_batches = ragged(rows, seed=sum(rows) + rows[0])
        sched.zero_grad()
        losses = sched.run(micro_batches=micro_batches)
        ref_losses, ref_grads = per_micro_reference(ref, micro_batches)
        assert_matches(sched, losses, ref_losses, ref_grads)
    evaluated = sched.evaluate(micro_batches=micro_batches)
    np.testing.assert_allclose([float(x.asnumpy()) for x in evaluated], ref_losses, atol=ATOL, rtol=RTOL)
    outputs = sched.evaluate(micro_batches=[(inputs, None) for inputs, _ in micro_batches])
    assert [o.shape[0] for o in outputs] == [3, 5]
