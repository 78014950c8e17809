"""MindSpore ONE models cut by ``graph_exec.models.split_model``, on one process.

Every case runs the split model through ``ScheduleMPipeTranspose`` with all stages local and
compares the per-micro-batch losses and every gradient with the *unsplit* mindone model's own
``construct`` differentiated by ``mindspore.value_and_grad`` (atol 1e-5, rtol 1e-4; in fact the
split is exact: pynative differences are 0). Two ranks: tests/multirank/test_mindone_models.py.
"""

from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest

import graph_exec as ge
import graph_exec.models as gm
from tests.models import mindone_models as mm
from tests.runtime.test_single_process import assert_matches

GRID = (1, 4, 4)  # the tiny Qwen2-VL preset's image grid


def split(name, model, num_stages, **options):
    if name == "qwen2vl":
        options.setdefault("image_grid", GRID)
    return gm.split_model(model, num_stages, **options)


def frozen_in_reference(ref, split_model):
    """Freeze in the reference what the split froze (the preprocess), by name."""
    frozen = {p.name for p in split_model.preprocess.get_parameters() if not p.requires_grad}
    for param in ref.get_parameters():
        if param.name in frozen:
            param.requires_grad = False


def run_and_compare(name, parts, ref, mode, micro=2, rows=4):
    num_stages = len(parts.stages)
    stages = [ge.PipelineStage(cell, k, num_stages) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        micro,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
    )
    inputs, labels = mm.batch(name, ref, rows)
    ref_losses, ref_grads = mm.reference(name, ref, inputs, labels, micro, scale=1.0 / micro)
    assert_matches(sched, sched.run(*inputs, labels=labels), ref_losses, ref_grads)
    return sched


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {}),  # the embedding as the (trainable) preprocess
        ("qwen2", {"preprocess": "none"}),  # the embedding in stage 0, no preprocess
        ("qwen2vl", {}),  # the frozen vision tower as the preprocess
        ("qwen2vl", {"trainable_preprocess": True}),
    ],
)
def test_split_model_matches_the_whole_model(name, options):
    model, ref = mm.whole(name), mm.whole(name)
    parts = split(name, model, 4, **options)
    assert parts.layers == (1, 1, 1, 1) and parts.family == name.replace("qwen2vl", "qwen2_vl")
    if parts.preprocess is not None:
        frozen_in_reference(ref, parts)
    run_and_compare(name, parts, ref, "pynative")
    names = [p.name for cell in parts.stages for p in cell.get_parameters()]
    assert set(names) <= {p.name for p in ref.get_parameters()}  # the model's own names, kept


def test_uneven_split_in_graph_mode_matches_the_whole_model():
    """Compiled chunks, one of them without any decoder layer (a rebalanced first stage)."""
    model, ref = mm.whole("llama"), mm.whole("llama")
    parts = split("llama", model, 4, layers=(0, 2, 1, 1))
    run_and_compare("llama", parts, ref, "graph")


def test_tied_embedding_and_head_are_reported_and_their_gradients_add_up():
    model, ref = mm.whole("llama", tie_word_embeddings=True), mm.whole("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    parts = split("llama", model, 2)
    assert parts.tied_weights == ("model.embed_tokens.weight", "lm_head.weight")
    head = parts.stages[-1].head.weight
    assert head is not model.model.embed_tokens.weight and head.name == "lm_head.weight"
    np.testing.assert_array_equal(head.asnumpy(), model.model.embed_tokens.weight.asnumpy())
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages, 2, parts.preprocess, 1, mode="pynative", loss_fn=gm.causal_lm_loss, scale_grads=True
    )
    inputs, labels = mm.batch("llama", ref, 4)
    ref_losses, ref_grads = mm.reference("llama", ref, inputs, labels, 2, scale=0.5)
    losses = sched.run(*inputs, labels=labels)
    np.testing.assert_allclose([float(x.asnumpy()) for x in losses], ref_losses, atol=1e-5, rtol=1e-4)
    grads = {k: v.asnumpy() for k, v in sched.grads().items()}
    tied = grads.pop("model.embed_tokens.weight") + grads.pop("lm_head.weight")
    np.testing.assert_allclose(tied, ref_grads.pop("model.embed_tokens.weight"), atol=1e-5, rtol=1e-4)
    assert set(grads) == set(ref_grads)
    for key, grad in grads.items():
        np.testing.assert_allclose(grad, ref_grads[key], atol=1e-5, rtol=1e-4, err_msg=key)


def test_the_readme_snippet_trains_a_tied_model_as_the_whole_model():
    """README "Real models: MindSpore ONE", as written there, with a ``tie_word_embeddings=True``
    Llama: ``tied_parameters=split.tied_weights`` (one bare pair) through a schedule holding
    every stage, compiled (the default mode). Losses and every gradient equal the whole model's
    (atol 1e-5, rtol 1e-4): each copy of the tied weight gets the sum of both uses' gradients,
    the whole model's gradient of its one matrix."""
    from graph_exec.examples import llama

    config = llama.config(llama.SIZES["tiny"], 4, tie_word_embeddings=True)
    ref = mm.whole("llama", tie_word_embeddings=True)
    P, V, M = 2, 1, 2  # the README's names
    ms.set_seed(0)  # the reference's seed: the same random weights
    model = gm.mindone().LlamaForCausalLM(config)
    split = gm.split_model(model, P * V)
    mine = [ge.PipelineStage(cell, k, P * V) for k, cell in enumerate(split.stages)]
    sched = ge.ScheduleMPipeTranspose(
        mine,
        M,
        split.preprocess,
        split.num_transpose_layers,
        loss_fn=gm.causal_lm_loss,
        tied_parameters=split.tied_weights,
    )
    ids, labels = llama.make_tokens(0, 4, llama.SIZES["tiny"].vocab)
    losses = sched.run(*gm.lm_inputs(ids), labels=labels)
    inputs = tuple(ms.Tensor(a) for a in gm.lm_inputs(ids))
    ref_losses, ref_grads = mm.reference("llama", ref, inputs, ms.Tensor(labels), M)
    embedding = ref_grads["model.embed_tokens.weight"]
    assert_matches(sched, losses, ref_losses, ref_grads | {"lm_head.weight": embedding})


def test_untied_model_reports_no_pair():
    assert split("llama", mm.whole("llama"), 2).tied_weights is None


def test_bad_arguments_are_named():
    model = mm.whole("llama")
    with pytest.raises(
        TypeError, match="LlamaForCausalLM, Qwen2ForCausalLM or Qwen2VLForConditionalGeneration"
    ):
        gm.split_model(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")), 2)
    with pytest.raises(ValueError, match=r"layers \[1, 1\] add up to 2, but the model has 4"):
        gm.split_model(model, 2, layers=(1, 1))
    with pytest.raises(ValueError, match="must be 2 integers >= 0"):
        gm.split_model(model, 2, layers=(5, -1))
    with pytest.raises(ValueError, match="fewer than num_stages=8"):
        gm.split_model(model, 8)
    with pytest.raises(
        ValueError, match=r"preprocess='vision' for llama; choose one of \('embedding', 'none'\)"
    ):
        gm.split_model(model, 2, preprocess="vision")
    with pytest.raises(ValueError, match="image_grid applies to Qwen2-VL only"):
        gm.split_model(model, 2, image_grid=GRID)
    vlm = mm.whole("qwen2vl")
    with pytest.raises(ValueError, match=r"image_grid must be \(t, h, w\).*or None \(any images\)"):
        gm.split_model(vlm, 2, image_grid=(1, 4))
    with pytest.raises(ValueError, match="multiples of spatial_merge_size 2"):
        gm.split_model(vlm, 2, image_grid=(1, 3, 4))


def test_vlm_inputs_refuse_mixed_grids():
    model = mm.whole("qwen2vl")
    ids = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="one equal grid per sample"):
        gm.vlm_inputs(model, ids, np.zeros((32, 96), np.float32), np.array([[1, 4, 4], [1, 2, 8]]))
    with pytest.raises(ValueError, match="pixel_values has 30 patch rows, but 2 images"):
        gm.vlm_inputs(model, ids, np.zeros((30, 96), np.float32), np.array([[1, 4, 4], [1, 4, 4]]))


def test_image_patches_lay_images_out_as_the_qwen2vl_processor_does():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
    )
    images = np.random.default_rng(0).random((2, 3, 16, 8), dtype=np.float32)
    theirs = processor(images=list(images), return_tensors="np", input_data_format="channels_first")
    mine = gm.image_patches(images, 4, 2, 2)
    assert mine.shape == (2, 8, 96) and theirs["image_grid_thw"].tolist() == [[1, 4, 2]] * 2
    np.testing.assert_array_equal(mine.reshape(-1, 96), theirs["pixel_values"])


@pytest.mark.parametrize("example", ["qwen2vl", "llama"])
def test_examples_build_and_train(example):
    """What `graph-exec run` builds: a split honouring layers= (and vision_depth=), loss falling."""
    from mindspore import nn

    from graph_exec.examples import load

    options = {"layers": (0, 2, 1, 1)} | ({"vision_depth": 2} if example == "qwen2vl" else {})
    model = load(example).build(4, **options)
    assert len(model.stages[0].blocks) == 0 and len(model.stages[1].blocks) == 2
    if example == "qwen2vl":
        assert len(model.preprocess.blocks) == 2 and model.num_transpose_layers == 4
        assert not model.preprocess.trainable_params()  # frozen by default
    stages = [ge.PipelineStage(cell, k, 4) for k, cell in enumerate(model.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages, 2, model.preprocess, model.num_transpose_layers, mode="pynative", loss_fn=model.loss_fn
    )
    optimizer = nn.Adam(sched.trainable_params(), learning_rate=3e-3)
    inputs, labels = model.batch(0, 4)  # one batch, learnt
    losses = []
    for _ in range(4):
        losses.append(np.mean([float(x.asnumpy()) for x in sched.run(*inputs, labels=labels)]))
        optimizer(tuple(sched.grads().values()))
        sched.zero_grad()
    assert losses[-1] < losses[0], losses


def test_the_tower_calibration_times_the_chunk_as_the_pipeline_runs_it():
    """``bench --tower-ratio``'s start-up costs: the chunk's taped ``F`` and its ``F`` + ``B``
    through the graph executor (every figure positive, the step longer than the forward),
    a vision block's forward from the tower at one and at ``DEEP`` blocks. In a process of its
    own bound to one core, as the bench runs it: unbound, with synchronous dispatch, the tower's
    time here jumped between 1.4 and 3 ms from call to call and hid the blocks' difference."""
    from graph_exec.cli.tower_sweep import calibrate

    costs = calibrate("tiny", 4, 2, "CPU", pin=True, timeout_s=300)
    assert costs.layers_per_chunk == 1
    assert 0 < costs.chunk_forward < costs.layer_step * costs.layers_per_chunk
    assert costs.tower_block > 0 and costs.tower_fixed >= 0
