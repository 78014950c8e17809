"""Batches of real Qwen2-VL samples (``graph_exec.models.vlm_batch``) on one process.

Each sample keeps its own images (0..k, each its own size) and text length; the split (made
without ``image_grid``) runs through ``ScheduleMPipeTranspose`` with every stage local, and
its per-micro-batch losses and every gradient are compared with the whole mindone model's own
``construct`` run on each *unpadded* sample (tests/models/mindone_models.py, ``vlm_reference``;
atol 1e-5, rtol 1e-4). Two ranks: tests/multirank/test_vlm_batch.py.
"""

import mindspore as ms
import numpy as np
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
    assert batch.patches.tolist() == [16, 28, 0, 8]
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


SIZES = ((8, 8), (16, 16), (16, 8), (24, 16), (8, 24))


def random_mix(rng, batch):
    """``batch`` samples of 0..2 images drawn from ``SIZES`` and 2..9 text tokens."""
    picks = []
    for _ in range(batch):
        count = int(rng.integers(0, 3))
        sizes = tuple(SIZES[int(i)] for i in rng.integers(0, len(SIZES), count))
        picks.append((sizes, int(rng.integers(2, 10))))
    return tuple(picks)


def test_twenty_mixed_batches_compile_each_kernel_at_most_three_times():
    """``shapes="dynamic"``, graph mode: 20 batches of different image mixes and text lengths
    (so different patch counts and lengths) compile each kernel at most 3 times, by MindSpore's
    own count, and the library adds no kernel after the first batch; the last batch's losses
    and gradients still equal the whole model's on each unpadded sample."""
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2)
    frozen_like(ref, parts)
    sched = schedule(parts, "graph", shapes="dynamic")
    rng = np.random.default_rng(7)
    kernels, shapes = None, set()
    for step in range(20):
        samples = mm.vlm_samples(random_mix(rng, 4), seed=step)
        batch = gm.vlm_batch(parts, samples)
        shapes.add((batch.inputs[0].shape[1], batch.inputs[3].shape[1]))
        sched.zero_grad()
        losses = sched.run(*(ms.Tensor(a) for a in batch.inputs), labels=ms.Tensor(batch.labels))
        stats = sched.stats()
        kernels = stats["compilations"] if kernels is None else kernels
        assert stats["compilations"] == kernels, (step, stats)
    assert len(shapes) >= 8, shapes  # the mix really varied the shapes
    assert stats["mindspore_compilations"] <= 3 * kernels, stats
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)


def sample(ids, *images, **extra):
    return {"input_ids": np.array(ids, np.int32), "images": list(images), **extra}


def test_bad_samples_are_named_before_anything_runs():
    from graph_exec.examples.qwen2vl import IMAGE_TOKEN as I
    from graph_exec.examples.qwen2vl import VISION_END as E
    from graph_exec.examples.qwen2vl import VISION_START as S

    model = mm.whole("qwen2vl", 2)
    good = sample([S, I, E, 5, 6], np.zeros((3, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"sample 1 image 0: image size 12x8 is not a multiple of .* = 8"):
        gm.vlm_batch(model, [good, sample([S, I, E, 5], np.zeros((3, 12, 8), np.float32))])
    with pytest.raises(
        ValueError,
        match=r"sample 1: input_ids has 1 image tokens in runs \[1\], but its 1 image\(s\) of grids \[\[1, 4, 4\]\] need runs \[4\]",
    ):
        gm.vlm_batch(model, [good, sample([S, I, E, 5], np.zeros((3, 16, 16), np.float32))])
    with pytest.raises(
        ValueError, match=r"sample 0: input_ids has 1 image tokens in runs \[1\], but its 0 image"
    ):
        gm.vlm_batch(model, [sample([S, I, E, 5])])
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens, which is above the largest pad_to size 8"):
        gm.vlm_batch(model, [good, sample([5] * 9)], pad_to=(4, 8))
    with pytest.raises(
        ValueError, match=r"sample 0 has 4 patches, which is above the largest patch_pad_to size 2"
    ):
        gm.vlm_batch(model, [good], patch_pad_to=2)
    with pytest.raises(ValueError, match=r"sample 0: labels has shape \[2\], input_ids \[5\]"):
        gm.vlm_batch(model, [good | {"labels": np.zeros(2, np.int32)}])
    with pytest.raises(ValueError, match=r"sample 0 image 0: an image is \(3, H, W\), got shape \[8, 8\]"):
        gm.vlm_batch(model, [sample([S, I, E], np.zeros((8, 8), np.float32))])


def models_rope_index(model, ids, mask, grids):
    """``(3, B, S)``: the model's own ``get_rope_index`` of ``ids`` (B, S) with ``mask`` and all
    rows' image grids in order (``None`` when there are none)."""
    grid = ms.Tensor(np.array(grids, np.int64)) if grids else None
    positions, _ = model.model.get_rope_index(ms.Tensor(ids), grid, None, ms.Tensor(mask))
    return positions.asnumpy()


def test_positions_are_computed_on_the_host_and_equal_the_models_get_rope_index(monkeypatch):
    """``vlm_batch`` computes the M-RoPE positions with numpy (``get_rope_index`` made to raise
    changes nothing), and they equal the model's own ``get_rope_index`` exactly on a text-only
    row, one image, two images of different grids, an image of ``t = 2``, all padded to 24; the
    rows with images also in one batched call (its image counter runs across rows); and
    ``mrope_positions`` alone on a row padded at the front."""
    from graph_exec.examples.qwen2vl import IMAGE_TOKEN as I
    from graph_exec.examples.qwen2vl import VISION_END as E
    from graph_exec.examples.qwen2vl import VISION_START as S
    from graph_exec.models.mrope import mrope_positions

    model = mm.whole("qwen2vl", 2)
    rng = np.random.default_rng(3)

    def pixels(h, w):
        return rng.standard_normal((3, h, w)).astype(np.float32)

    two_frames = {"pixel_values": rng.standard_normal((32, 96)).astype(np.float32), "grid_thw": (2, 4, 4)}
    samples = [
        sample([5, 6, 7]),
        sample([5, S, *[I] * 4, E, 8, 9], pixels(16, 16)),
        sample([S, I, E, 3, S, *[I] * 6, E, 4, 5, 6], pixels(8, 8), pixels(16, 24)),
        sample([9, S, *[I] * 8, E, 2], two_frames),
    ]
    grids = [[], [(1, 4, 4)], [(1, 2, 2), (1, 4, 6)], [(2, 4, 4)]]

    def refuse(*args, **kwargs):
        raise AssertionError("vlm_batch called the model's get_rope_index")

    monkeypatch.setattr(model.model, "get_rope_index", refuse)
    batch = gm.vlm_batch(model, samples, pad_to=24)
    monkeypatch.undo()
    _, _, _, ids, positions, mask = batch.inputs
    assert positions.shape == (4, 3, 24) and positions.dtype == np.int32
    for b, grid in enumerate(grids):
        theirs = models_rope_index(model, ids[b : b + 1], mask[b : b + 1], grid)[:, 0]
        np.testing.assert_array_equal(positions[b], theirs, err_msg=f"row {b}")
    assert positions[2, 0, 14] == positions[2, 0, 13] + 1 and (positions[2, :, 15:] == 1).all()  # text, pad
    batched = models_rope_index(model, ids[1:], mask[1:], [g for row in grids[1:] for g in row])
    np.testing.assert_array_equal(positions[1:], batched.transpose(1, 0, 2))
    front = np.concatenate([[0, 0], ids[2, :16]])[None]
    front_mask = np.concatenate([[0, 0], mask[2, :16]])[None]
    mine = mrope_positions(front[0], front_mask[0], grids[2], 2, I)
    np.testing.assert_array_equal(mine, models_rope_index(model, front, front_mask, grids[2])[:, 0])
    with pytest.raises(
        ValueError, match=r"image 1 of grid \[1, 2, 2\] has no image token 124 after kept token 6"
    ):
        mrope_positions(ids[1], mask[1], [(1, 4, 4), (1, 2, 2)], 2, I)


def test_processed_images_and_rotary_positions_are_the_models_own():
    """A processed image (patches + grid) batches as its pixels do, and the per-patch rotary
    rows give the model's own ``rot_pos_emb``."""
    from graph_exec.examples.qwen2vl import IMAGE_TOKEN as I
    from graph_exec.examples.qwen2vl import VISION_END as E
    from graph_exec.examples.qwen2vl import VISION_START as S
    from graph_exec.models.vlm_batch import rotary_positions

    model = mm.whole("qwen2vl", 2)
    image = np.random.default_rng(0).standard_normal((3, 16, 24)).astype(np.float32)
    ids = [S] + [I] * 6 + [E, 7]
    patches = gm.image_patches(image[None], 4, 2, 2)[0]
    raw = gm.vlm_batch(model, [sample(ids, image)])
    done = gm.vlm_batch(model, [sample(ids, {"pixel_values": patches, "grid_thw": (1, 4, 6)})])
    for a, b in zip(raw.inputs, done.inputs, strict=True):
        np.testing.assert_array_equal(a, b)
    visual = model.model.visual
    theirs = visual.rot_pos_emb(ms.Tensor(np.array([[1, 4, 6]], np.int64))).asnumpy()
    inv_freq = visual.rotary_pos_emb.inv_freq.asnumpy()
    mine = (rotary_positions((1, 4, 6), 2)[..., None].astype(np.float32) * inv_freq).reshape(24, -1)
    np.testing.assert_array_equal(mine, theirs)


def test_the_example_with_mixed_images_builds_and_trains():
    """What ``graph-exec run qwen2vl --image-sizes 16x16,16x8,8x8 --images-per-sample 0-2``
    builds: a split without a fixed grid, batches whose patch counts differ from step to step,
    and a loss that falls on one batch learnt."""
    from mindspore import nn

    from graph_exec.examples import load

    sizes, counts = [(16, 16), (16, 8), (8, 8)], (0, 2)
    model = load("qwen2vl").build(2, image_sizes=sizes, images_per_sample=counts)
    assert "0-2 images per sample of 16x16, 16x8, 8x8 px" in model.summary
    patches = {model.batch(step, 4)[0][0].shape[1] for step in range(6)}
    assert len(patches) > 1, patches
    sched = schedule(model.split, "pynative")
    optimizer = nn.Adam(sched.trainable_params(), learning_rate=3e-3)
    inputs, labels = model.batch(0, 4)
    losses = []
    for _ in range(4):
        losses.append(np.mean([float(x.asnumpy()) for x in sched.run(*inputs, labels=labels)]))
        optimizer(tuple(sched.grads().values()))
        sched.zero_grad()
    assert losses[-1] < losses[0], losses


def tower_shapes(sched, monkeypatch) -> list[tuple[int, ...]]:
    """The ``pixel_values`` shape of every tower forward the schedule's executor runs, in order."""
    sched.set_up()
    executor, seen = sched._setup.executor, []

    def spying(original):
        def spy(*args):
            seen.append(tuple(args[-2][0].shape))  # (..., inputs, kwargs)
            return original(*args)

        return spy

    for name in ("preprocess_forward", "preprocess_forward_taped"):
        monkeypatch.setattr(executor, name, spying(getattr(executor, name)))
    return seen


@pytest.mark.parametrize(("mode", "trainable"), [("pynative", False), ("graph", True)])
def test_ragged_micro_batches_match_the_whole_model_on_each_unpadded_sample(mode, trainable, monkeypatch):
    """``vlm_micro_batches`` pads each micro-batch to its own sizes (micro-batch 0: a sample of
    two images, 28 patches, 14 tokens; micro-batch 1: a text-only sample and 8 patches, 11
    tokens), the tower runs at each one's own patch count, and the losses and every gradient
    still equal the whole model's on each unpadded sample."""
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2, trainable_preprocess=trainable)
    frozen_like(ref, parts)
    samples = mm.vlm_samples()
    batches = gm.vlm_micro_batches(parts, samples, MICRO)
    assert [b.inputs[0].shape[1] for b in batches] == [28, 8]
    assert [b.inputs[3].shape[1] for b in batches] == [14, 11]
    assert gm.vlm_tower_costs(batches) == [44.0, 8.0] == [float(b.patches.sum()) for b in batches]
    whole = gm.vlm_batch(parts, samples)  # the same rows, cropped to each micro-batch's sizes
    for m, b in enumerate(batches):
        for mine, cut in zip((*b.inputs, b.labels), (*whole.inputs, whole.labels), strict=True):
            crop = (slice(2 * m, 2 * m + 2), *(slice(0, n) for n in mine.shape[1:]))
            np.testing.assert_array_equal(mine, cut[crop])
    sched = schedule(parts, mode)
    towers = tower_shapes(sched, monkeypatch)
    losses = sched.run(micro_batches=batches)
    row = batches[0].inputs[0].shape[2]
    assert sorted(towers) == [(2, 8, row), (2, 28, row)]
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)


def test_balanced_placement_of_ragged_micro_batches_keeps_the_users_order(monkeypatch):
    """With ``tower_order="balanced"`` and ``tower_costs`` from the batches, a placement that
    reverses the micro-batches (one process keeps arrival order by itself, so the decision is
    patched as in tests/runtime/test_tower_order.py) runs the light tower first at its own
    shape; the losses come back in the user's order and the gradients are unchanged."""
    from graph_exec.schedule import placement

    decided = []

    def reverse(positions, costs, mode):
        decided.append((tuple(costs), mode))
        return tuple(reversed(range(len(costs))))

    monkeypatch.setattr(placement, "tower_order", reverse)
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2)
    frozen_like(ref, parts)
    samples = mm.vlm_samples()
    batches = gm.vlm_micro_batches(parts, samples, MICRO)
    sched = schedule(parts, "pynative", tower_order="balanced")
    towers = tower_shapes(sched, monkeypatch)
    losses = sched.run(micro_batches=batches, tower_costs=gm.vlm_tower_costs(batches))
    assert decided == [((44.0, 8.0), "balanced")]
    row = batches[0].inputs[0].shape[2]
    assert towers == [(2, 8, row), (2, 28, row)]  # the user's micro-batch 1 ran first
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)


def test_ragged_micro_batches_compile_within_the_dynamic_bound():
    """``shapes="dynamic"``, graph mode: 10 steps of ragged micro-batches (each step's two
    micro-batches of different patch counts and lengths, new mixes every step) compile no
    library kernel after the first step and each kernel at most 3 times by MindSpore's count
    (docs/shapes.md); the last step still matches the whole model on each unpadded sample."""
    model, ref = mm.whole("qwen2vl", 2), mm.whole("qwen2vl", 2)
    parts = gm.split_model(model, 2)
    frozen_like(ref, parts)
    sched = schedule(parts, "graph", shapes="dynamic")
    rng = np.random.default_rng(11)
    kernels, shapes = None, set()
    for step in range(10):
        samples = mm.vlm_samples(random_mix(rng, 4), seed=step)
        batches = gm.vlm_micro_batches(parts, samples, MICRO)
        shapes |= {(b.inputs[0].shape[1], b.inputs[3].shape[1]) for b in batches}
        sched.zero_grad()
        losses = sched.run(micro_batches=batches)
        stats = sched.stats()
        kernels = stats["compilations"] if kernels is None else kernels
        assert stats["compilations"] == kernels, (step, stats)
    assert len(shapes) >= 8, shapes
    assert stats["mindspore_compilations"] <= 3 * kernels, stats
    ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
    assert_matches(sched, losses, ref_losses, ref_grads)
