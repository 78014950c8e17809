"""``tower_order="balanced"`` on one process: the runtime runs the micro-batches in the placement's
order and gives back the losses in the user's order, the gradients unchanged up to summation
order (atol 1e-5, rtol 1e-4 against the non-pipelined reference).

With ``P = 1`` every tower runs on rank 0 and the decision itself keeps arrival order (nothing to
gain), so the permutation path is driven here by a decision patched to reverse the micro-batches;
the decision is tested on its own in ``tests/unit/test_tower_placement.py``.
"""

import numpy as np
import pytest

import graph_exec as ge
from graph_exec.errors import GraphExecError
from graph_exec.runtime.driver import RankRuntime
from graph_exec.schedule import placement
from tests.models.common import ATOL, RTOL, loss_fn
from tests.models.pipeline import batch, build, reference

MICRO = 4


def schedule(model, cls=ge.ScheduleMPipeTranspose, **options):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    return cls(stages, MICRO, model.preprocess, 1, loss_fn=loss_fn, **options)


@pytest.fixture
def ran(monkeypatch):
    """The first input of every micro-batch, in the order the driver received them."""
    seen = []
    original = RankRuntime.run

    def spy(self, batch, *tag):
        seen.append([inputs[0].asnumpy().copy() for inputs in batch.inputs])
        return original(self, batch, *tag)

    monkeypatch.setattr(RankRuntime, "run", spy)
    return seen


@pytest.fixture
def reversing_decision(monkeypatch):
    """The placement decides to run the user's micro-batches back to front; records each call."""
    calls = []

    def reverse(positions, costs, mode):
        calls.append((tuple(costs), mode))
        return tuple(reversed(range(len(costs)))) if mode == "balanced" else tuple(range(len(costs)))

    monkeypatch.setattr(placement, "tower_order", reverse)
    return calls


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen"])
@pytest.mark.parametrize("cls", [ge.ScheduleMPipeTranspose, ge.ScheduleInterleaved1F1B])
def test_balanced_losses_in_user_order_and_gradients_match(mode, preprocess, cls, reversing_decision, ran):
    model, ref = build(3, preprocess), build(3, preprocess)
    x, labels = batch(8)
    sched = schedule(model, cls, mode=mode, tower_order="balanced")
    costs = [1.0, 4.0, 2.0, 3.0]
    losses = sched.run(x, labels=labels, tower_costs=costs)
    assert reversing_decision == [(tuple(costs), "balanced")]
    per = 8 // MICRO
    for m, rows in enumerate(ran[0]):  # plan micro m ran the user's micro-batch 3 - m
        np.testing.assert_array_equal(rows, x.asnumpy()[(3 - m) * per : (4 - m) * per])
    ref_losses, ref_grads = reference(ref, x, labels, MICRO)
    assert len(set(np.round(ref_losses, 6))) == MICRO  # distinct: a missed un-permutation shows
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], ref_losses, atol=ATOL, rtol=RTOL)
    grads = sched.grads()
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad.asnumpy(), ref_grads[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_balanced_evaluate_returns_the_users_order(reversing_decision):
    model, ref = build(3, "frozen"), build(3, "frozen")
    x, labels = batch(8)
    sched = schedule(model, mode="pynative", tower_order="balanced")
    losses = sched.evaluate(x, labels=labels, tower_costs=[1, 2, 3, 4])
    ref_losses, _ = reference(ref, x, labels, MICRO)
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], ref_losses, atol=ATOL, rtol=RTOL)
    outputs = sched.evaluate(x, tower_costs=[1, 2, 3, 4])
    per = 8 // MICRO
    for m, out in enumerate(outputs):  # the user's micro-batch m, through the whole model at once
        h = ref.preprocess(x[m * per : (m + 1) * per])
        for stage in ref.stages:
            h = stage(*h) if isinstance(h, tuple) else stage(h)
        np.testing.assert_allclose(out.asnumpy(), h.asnumpy(), atol=ATOL, rtol=RTOL)


def test_arrival_takes_costs_and_keeps_the_order(reversing_decision):
    model, ref = build(3, "frozen"), build(3, "frozen")
    x, labels = batch(8)
    sched = schedule(model, mode="pynative")
    losses = sched.run(x, labels=labels, tower_costs=[1, 9, 1, 1])
    assert reversing_decision == []  # arrival never asks the placement
    ref_losses, _ = reference(ref, x, labels, MICRO)
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], ref_losses, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("options", "call", "words"),
    [
        ({"tower_order": "heavy"}, None, "tower_order"),
        ({"tower_order": "balanced", "preprocess": None}, None, "there is no preprocess"),
        ({"tower_order": "balanced"}, {}, "needs tower_costs"),
        ({"tower_order": "balanced"}, {"tower_costs": [1, 2]}, "has 2 values but there are 4 micro-batches"),
        ({}, {"tower_costs": [1, 2, -3, 4]}, "tower_costs[2] = -3"),
    ],
)
def test_bad_tower_options_are_clear_errors(options, call, words):
    model = build(3, "frozen")
    stages = [ge.PipelineStage(cell, k, 3) for k, cell in enumerate(model.stages)]
    pre = options.pop("preprocess", model.preprocess)
    layers = 0 if pre is None else 1
    x, labels = batch(8)
    if call is None:
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            ge.ScheduleMPipeTranspose(stages, MICRO, pre, layers, loss_fn=loss_fn, **options)
        return
    sched = ge.ScheduleMPipeTranspose(stages, MICRO, pre, layers, loss_fn=loss_fn, mode="pynative", **options)
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        sched.run(x, labels=labels, **call)
    assert sched._setup is None  # refused before anything was set up


def test_placement_is_the_order_run_uses_and_owned_input_needs_owned(reversing_decision, ran):
    """``placement(costs)`` is the order ``run()`` then applies; ``owned_input()`` refuses a
    schedule whose ranks all hold the whole batch (owned input with balanced order runs on real
    ranks: tests/multirank/test_owned_data.py)."""
    model, ref = build(3, "frozen"), build(3, "frozen")
    sched = schedule(model, mode="pynative", tower_order="balanced")
    costs = [1.0, 2.0, 3.0, 4.0]
    assert sched.placement(costs) == (3, 2, 1, 0)
    x, labels = batch(8)
    losses = sched.run(x, labels=labels, tower_costs=costs)
    per = 8 // MICRO
    for m, user in enumerate(sched.placement(costs)):
        np.testing.assert_array_equal(ran[0][m], x.asnumpy()[user * per : (user + 1) * per])
    ref_losses = reference(ref, x, labels, MICRO)[0]
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], ref_losses, atol=ATOL, rtol=RTOL)
    with pytest.raises(GraphExecError, match="owned_input\\(\\) needs input='owned'"):
        sched.owned_input(costs)


def test_a_checkpoint_of_one_tower_order_loads_into_the_other(tmp_path):
    """The order changes the micro-batches' summation order, not what is trained."""
    saved = schedule(build(3, "trainable"), mode="pynative")
    x, labels = batch(8)
    saved.run(x, labels=labels)
    saved.zero_grad()
    ge.save_checkpoint(saved, tmp_path, 1)
    resumed = schedule(build(3, "trainable", seed=7), mode="pynative", tower_order="balanced")
    assert ge.load_checkpoint(resumed, tmp_path) == 1
