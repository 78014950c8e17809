"""The runtime on one process (P = 1, every stage local): no communication needed.

Numbers are checked against the non-pipelined reference (atol 1e-5, rtol 1e-4).
"""

import pytest

import graph_exec as ge
from tests.models.common import assert_matches, loss_fn
from tests.models.pipeline import batch, build, reference


def schedule(model, micro, mode="graph", **options):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    layers = 0 if model.preprocess is None else 1
    return ge.ScheduleMPipeTranspose(
        stages, micro, model.preprocess, layers, mode=mode, loss_fn=loss_fn, **options
    )


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen", "none"])
def test_one_rank_pipeline_matches_reference(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    x, labels = batch(8)
    sched = schedule(model, 4, mode=mode, scale_grads=True)
    losses = sched.run(x, labels=labels)
    ref_losses, ref_grads = reference(ref, x, labels, 4, scale=0.25)
    assert_matches(sched, losses, ref_losses, ref_grads)
    assert sched.plan.config.pp == 1 and sched.plan.config.vpp == 3


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_kept_preprocess_tape_matches_reference(mode):
    """On one rank every TFWD and its backward share the rank: all are taped, none recomputed."""
    model, ref = build(3, "trainable"), build(3, "trainable")
    sched = schedule(model, 4, mode=mode, keep_preprocess_tape=True)
    first_x, first_labels = batch(8, seed=5)
    sched.run(first_x, labels=first_labels)
    executor = sched._setup.executor
    taped = []

    def no_recompute(*args, **kwargs):
        raise AssertionError("the preprocess was recomputed although its tape was kept")

    def count_taped(key, cotangents, backward=executor.preprocess_backward_taped):
        taped.append(key)
        return backward(key, cotangents)

    executor.preprocess_backward = no_recompute
    executor.preprocess_backward_taped = count_taped
    sched.zero_grad()
    x, labels = batch(8)
    losses = sched.run(x, labels=labels)
    ref_losses, ref_grads = reference(ref, x, labels, 4)
    assert_matches(sched, losses, ref_losses, ref_grads)
    assert len(taped) == 4 and not executor.kept()


def test_batch_not_divisible_is_a_clear_error():
    sched = schedule(build(2, "none"), 3)
    x, labels = batch(8)
    with pytest.raises(ValueError, match=r"batch size 8 .* not divisible by micro_batch_num=3"):
        sched.run(x, labels=labels)


def test_labels_required_with_loss_fn():
    sched = schedule(build(2, "none"), 2)
    with pytest.raises(ValueError, match="labels are required"):
        sched.run(batch(4)[0])


def test_unknown_mode_named():
    with pytest.raises(ValueError, match="mode must be one of 'graph', 'pynative', got 'eager'"):
        schedule(build(2, "none"), 2, mode="eager")


def test_partial_stages_without_communication_say_how_to_launch():
    model = build(4, "none")
    stages = [ge.PipelineStage(model.stages[k], k, 4) for k in (0, 2)]
    sched = ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn)
    with pytest.raises(ge.errors.CommunicationNotInitializedError, match="msrun"):
        sched.run(*batch(4)[:1], labels=batch(4)[1])
