"""The split backward (``body="zb"``: ``I`` + ``W`` steps) on one process, and its executor hooks.

Losses and every gradient are checked against the non-pipelined reference (atol 1e-5,
rtol 1e-4); the multi-rank cases are in tests/multirank/test_zero_bubble.py.
"""

import numpy as np
import pytest
from mindspore import Tensor

from graph_exec.executors import HookOrderError, create_executor
from tests.models.common import ATOL, RTOL, loss_fn
from tests.models.pipeline import batch, build, reference
from tests.runtime.test_fair_baseline import baseline
from tests.runtime.test_single_process import assert_matches, schedule


def _walked(sched):
    return [event.step for event in sched.timeline]


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen", "none"])
def test_zb_one_rank_matches_reference(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    x, labels = batch(8)
    sched = schedule(model, 4, mode=mode, scale_grads=True, body="zb")
    ref_losses, ref_grads = reference(ref, x, labels, 4, scale=0.25)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    tokens = _walked(sched)
    assert sched.plan.config.split_backward and not any(t.startswith("B") for t in tokens)
    assert sum(t.startswith("I") for t in tokens) == sum(t.startswith("W") for t in tokens) == 12
    assert not sched._setup.executor.kept()
    # A second step without zero_grad adds up: nothing held leaked from the first.
    losses = sched.run(x, labels=labels)
    assert_matches(sched, losses, ref_losses, {k: 2 * v for k, v in ref_grads.items()})


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_zb_fair_baseline_one_rank_matches_reference(mode):
    model, ref = build(3, "trainable"), build(3, "trainable")
    x, labels = batch(8)
    sched = baseline(model, 4, mode=mode, body="zb")
    ref_losses, ref_grads = reference(ref, x, labels, 4)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    tokens = _walked(sched)
    # TBWD m follows I 0.m: the preprocess backward does not wait for the deferred W 0.m.
    for m in range(4):
        assert tokens.index(f"TBWD{m}") == tokens.index(f"I0.{m}") + 1


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_split_hooks_equal_the_whole_backward(mode):
    """stage_backward_input + stage_backward_weight give stage_backward's gradients, with
    forwards of several micro-batches in flight and the halves out of order (weight gradients
    up to the order of the adds, atol 1e-5 / rtol 1e-4)."""
    x, _ = batch(8)
    cot = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    results = []
    for split in (False, True):
        model = build(2, "none")
        ex = create_executor(mode, {0: model.stages[0]}, loss_fn=loss_fn, last_stage=1)
        outs = [ex.stage_forward(0, m, (x,)) for m in range(3)]
        assert all(o[0].shape == (8, 8) for o in outs)
        grads_in = {}
        for m in (1, 0, 2):
            if split:
                grads_in[m] = ex.stage_backward_input(0, m, (Tensor(cot * (m + 1)),))
            else:
                grads_in[m] = ex.stage_backward(0, m, (Tensor(cot * (m + 1)),))
        if split:
            assert sorted(ex.kept()) == [("weight_grads", 0, m) for m in range(3)]
            assert all(not np.any(g.asnumpy()) for g in ex.grads().values())  # nothing added yet
            for m in (2, 0, 1):
                ex.stage_backward_weight(0, m)
            with pytest.raises(HookOrderError, match=r"stage_backward_weight\(stage 0, micro 1\)"):
                ex.stage_backward_weight(0, 1)
        assert not ex.kept()
        results.append(
            (
                {m: g[0].asnumpy() for m, g in grads_in.items()},
                {k: v.asnumpy() for k, v in ex.grads().items()},
            )
        )
    (whole_in, whole_w), (split_in, split_w) = results
    for m in whole_in:  # the same bprop: bit for bit
        np.testing.assert_array_equal(split_in[m], whole_in[m])
    assert set(split_w) == set(whole_w)
    for name in whole_w:
        np.testing.assert_allclose(split_w[name], whole_w[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_held_weight_gradients_are_dropped_on_abort():
    model = build(2, "none")
    ex = create_executor("graph", {0: model.stages[0]}, loss_fn=loss_fn, last_stage=1)
    x, _ = batch(4)
    out = ex.stage_forward(0, 0, (x,))
    ex.stage_backward_input(0, 0, (out[0],))
    assert ex.kept() == [("weight_grads", 0, 0)]
    ex.drop_kept()
    assert not ex.kept()


def test_a_bad_body_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match=r"body must be one of 'interleaved', '1f1b', 'gpipe', 'zb', got 'zz'"
    ):
        schedule(build(2, "none"), 2, body="zz")
