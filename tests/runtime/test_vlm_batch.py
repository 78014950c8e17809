"""Batches of real Qwen2-VL samples (``graph_exec.models.vlm_batch``) on one process.

Each sample keeps its own images (0..k, each its own size) and text length; the split (made
without ``image_grid``) runs through ``ScheduleMPipeTranspose`` with every stage local, and
its per-micro-batch losses and every gradient are compared with the whole mindone model's own
``construct`` run on each *unpadded* sample (tests/models/mindone_models.py, ``vlm_reference``;
atol 1e-5, rtol 1e-4). Two ranks: tests/multirank/test_vlm_batch.py.
"""

import mindspore as ms
import pytest

import graph_exec as ge
import graph_exec.models as gm
from tests.models import mindone_models as mm
from tests.runtime.test_single_process import assert_matches

MICRO = 2


def schedule(parts, mode, **options):
    stages = [ge.PipelineStage(cell, k, len(parts.stages)) for k, cell in enumerate(parts.stages)]
    return ge.ScheduleMPipeTranspose(
        stages,
        MICRO,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
        **options,
    )


def frozen_like(ref, parts):
    frozen = {p.name for p in parts.preprocess.get_parameters() if not p.requires_grad}
    for param in ref.get_parameters():
        param.requires_grad = param.requires_grad and param.name not in frozen


@pytest.mark.parametrize(("mode", "trainable"), [("pynative", False), ("pynative", True), ("graph", True)])
def test_a_mixed_batch_matches_the_whole_model_on_each_unpadded_sample(mode, trainable):
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2, trainable_preprocess=trainable)
    frozen_like(ref, parts)
    samples = mm.vlm_samples()
    batch = gm.vlm_batch(parts, samples)
    pixels, patch_image, _, ids, _, mask = batch.inputs
    assert pixels.shape[:2] == (4, 28) and ids.shape == (4, 14)  # the largest sample pads the rest
    assert mask.sum(1).tolist() == [len(s["input_ids"]) for s in samples]
    assert patch_image[1].tolist() == [0] * 4 + [1] * 24 and (patch_image[2] == -1).all()
    sched = schedule(parts, mode)
    losses = sched.run(*(ms.Tensor(a) for a in batch.inputs), labels=ms.Tensor(batch.labels))
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)


def test_bucketed_padding_changes_nothing():
    """Padding text and patches further (``pad_to``, ``patch_pad_to`` buckets) gives the same
    losses and gradients: pads are masked in the tower and the decoder and carry no loss."""
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2)
    frozen_like(ref, parts)
    samples = mm.vlm_samples()
    batch = gm.vlm_batch(parts, samples, pad_to=(8, 16), patch_pad_to=(16, 48))
    assert batch.inputs[0].shape[1] == 48 and batch.inputs[3].shape[1] == 16
    sched = schedule(parts, "pynative")
    losses = sched.run(*(ms.Tensor(a) for a in batch.inputs), labels=ms.Tensor(batch.labels))
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)
