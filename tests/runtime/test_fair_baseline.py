"""The fair baseline (``ScheduleInterleaved1F1B`` with a preprocess) on one process.

Losses and every gradient are checked against the non-pipelined reference (atol 1e-5,
rtol 1e-4); the multi-rank cases (P=2, P=4) are in tests/multirank/test_fair_baseline.py.
"""

import pytest

import graph_exec as ge
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build, reference
from tests.runtime.test_single_process import assert_matches


def baseline(model, micro, mode="graph", **options):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    layers = 0 if model.preprocess is None else 1
    return ge.ScheduleInterleaved1F1B(
        stages, micro, model.preprocess, layers, mode=mode, loss_fn=loss_fn, **options
    )


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen"])
def test_one_rank_fair_baseline_matches_reference(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    x, labels = batch(8)
    sched = baseline(model, 4, mode=mode)
    ref_losses, ref_grads = reference(ref, x, labels, 4)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    # Again without zero_grad: the kept preprocess state was freed, the gradients add up.
    losses = sched.run(x, labels=labels)
    assert_matches(sched, losses, ref_losses, {k: 2 * v for k, v in ref_grads.items()})
    config = sched.plan.config
    assert not config.transpose and config.preprocess == preprocess
    tokens = [event.step for event in sched.timeline]
    assert tokens.count("BCAST") == 0
    assert [t for t in tokens if t.startswith("TFWD")] == [f"TFWD{m}" for m in range(4)]
    tbwd = [t for t in tokens if t.startswith("TBWD")]
    assert len(tbwd) == (4 if preprocess == "trainable" else 0)
    for m in range(4):  # the preprocess forward right before F 0.m, its backward right after B 0.m
        assert tokens[tokens.index(f"TFWD{m}") + 1] == f"F0.{m}"
        if tbwd:
            assert tokens[tokens.index(f"B0.{m}") + 1] == f"TBWD{m}"


def test_frozen_baseline_never_runs_a_preprocess_backward(monkeypatch):
    model, ref = build(2, "frozen"), build(2, "frozen")
    x, labels = batch(4)
    sched = baseline(model, 2)
    sched.run(x, labels=labels)  # sets up the executor
    calls = []
    executor = sched._setup.executor
    for hook in ("preprocess_backward", "preprocess_backward_taped", "preprocess_forward_taped"):
        original = getattr(executor, hook)
        monkeypatch.setattr(
            executor, hook, lambda *a, _hook=hook, _original=original: calls.append(_hook) or _original(*a)
        )
    sched.zero_grad()
    ref_losses, ref_grads = reference(ref, x, labels, 2)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    assert calls == []


def test_rank_0_must_pass_the_preprocess():
    model = build(2, "trainable")
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(model.stages)]
    sched = ge.ScheduleInterleaved1F1B(stages, 2, None, 1, loss_fn=loss_fn)
    x, labels = batch(4)
    with pytest.raises(ValueError, match=r"num_transpose_layers=1 but rank 0 has no preprocess_module"):
        sched.run(x, labels=labels)


def test_preprocess_without_layers_is_refused():
    model = build(2, "frozen")
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(model.stages)]
    with pytest.raises(ValueError, match=r"num_transpose_layers=0 with preprocess_module=Projector"):
        ge.ScheduleInterleaved1F1B(stages, 2, model.preprocess, 0, loss_fn=loss_fn)
