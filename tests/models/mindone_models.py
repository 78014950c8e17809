"""MindSpore ONE models for the tests: tiny random configs, and the unsplit reference.

The reference runs the *whole* mindone model's own ``construct`` (eagerly: it does not compile
for Qwen2 and Qwen2-VL) on each micro-batch and differentiates the mean next-token loss with
``mindspore.value_and_grad`` over the model's trainable parameters, keyed by name: what a split
model must reproduce exactly.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np

import graph_exec.models as gm
from graph_exec.examples import llama, qwen2vl


def qwen2(layers: int = 4, seed: int = 0):
    from transformers import Qwen2Config

    ms.set_seed(seed)
    return gm.mindone().Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )


def whole(name: str, layers: int = 4, seed: int = 0, **options):
    """A whole tiny model: ``llama``, ``qwen2`` or ``qwen2vl``."""
    if name == "llama":
        return llama.model("tiny", layers, seed, **options)
    if name == "qwen2":
        return qwen2(layers, seed)
    return qwen2vl.model("tiny", layers, seed=seed, **options)


def batch(name: str, model, rows: int, step: int = 0):
    """``(pipeline inputs, labels)`` for ``model``."""
    if name == "qwen2vl":
        return qwen2vl.batch(model, step, rows)
    return llama.batch(step, rows)


def logits_of(name: str, model, inputs) -> ms.Tensor:
    """The whole model's logits for a pipeline input (its own construct, its own inputs)."""
    if name == "qwen2vl":
        pixels, ids, _ = inputs
        grid = ms.Tensor(np.tile(np.array(qwen2vl.SIZES["tiny"].grid, np.int64), (ids.shape[0], 1)))
        flat = pixels.reshape(-1, pixels.shape[-1])
        return model(input_ids=ids, pixel_values=flat, image_grid_thw=grid).logits
    out = model(inputs[0])
    return out[0] if isinstance(out, tuple) else out.logits


def reference(name: str, model, inputs, labels, micro: int, scale: float = 1.0):
    """Per-micro-batch losses and the summed (x ``scale``) gradients of every trainable parameter."""
    params = model.trainable_params()

    def loss(*args):
        *pipeline_inputs, target = args
        return gm.causal_lm_loss(logits_of(name, model, pipeline_inputs), target)

    grad_fn = ms.value_and_grad(loss, None, params)
    rows = labels.shape[0] // micro
    losses, total = [], None
    for m in range(micro):
        cut = slice(m * rows, (m + 1) * rows)
        value, grads = grad_fn(*(t[cut] for t in inputs), labels[cut])
        losses.append(float(value.asnumpy()))
        arrays = [g.asnumpy() * scale for g in grads]
        total = arrays if total is None else [a + b for a, b in zip(total, arrays, strict=True)]
    return losses, {p.name: g for p, g in zip(params, total, strict=True)}


#: A batch of four samples for the tiny Qwen2-VL (patch 4, merge 2): (image sizes (H, W), text
#: tokens). Three different grids (16x16, 8x8 + 24x16, 16x8), a sample with two images, a
#: text-only one and four text lengths; two samples per micro-batch at M=2.
VLM_MIX = (
    (((16, 16),), 5),
    (((8, 8), (24, 16)), 3),
    ((), 9),
    (((16, 8),), 7),
)


def vlm_samples(mix=VLM_MIX, seed: int = 0) -> list[dict]:
    """Samples as Qwen2-VL's processor writes them: per image ``<vs> <image>×(t·h·w/4) <ve>``,
    then the text; random pixels and text ids (below the special tokens), default labels."""
    rng = np.random.default_rng(seed)
    preset = qwen2vl.SIZES["tiny"]
    return [qwen2vl.random_sample(sizes, text, preset, rng) for sizes, text in mix]


def vlm_reference(model, samples: list[dict], micro: int, scale: float = 1.0):
    """The whole model's own ``construct`` on each *unpadded* sample, one at a time: the
    per-micro-batch losses of ``causal_lm_loss`` over the micro-batch's padded batch (the mean
    over its real labels: each sample's summed loss over the micro-batch's label count) and the
    summed (x ``scale``) gradients of every trainable parameter, by name."""
    from graph_exec.models.vlm_batch import default_labels

    preset = qwen2vl.SIZES["tiny"]
    params = model.trainable_params()

    def loss(ids, labels, weight, *vision):
        pixels, grid = vision if vision else (None, None)
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
        return gm.causal_lm_loss(logits, labels) * weight

    grad_fn = ms.value_and_grad(loss, None, params)
    rows = len(samples) // micro
    losses, total = [], None
    for m in range(micro):
        group = samples[m * rows : (m + 1) * rows]
        labels = [default_labels(s["input_ids"], qwen2vl.IMAGE_TOKEN) for s in group]
        count = sum(int((lab >= 0).sum()) for lab in labels)
        value_sum = 0.0
        for sample, lab in zip(group, labels, strict=True):
            vision = ()
            if sample["images"]:
                patches = [
                    gm.image_patches(i[None], preset.patch, preset.temporal, preset.merge)[0]
                    for i in sample["images"]
                ]
                grid = [(1, i.shape[1] // preset.patch, i.shape[2] // preset.patch) for i in sample["images"]]
                vision = (ms.Tensor(np.concatenate(patches)), ms.Tensor(np.array(grid, np.int64)))
            weight = ms.Tensor(float((lab >= 0).sum()) / count, ms.float32)
            ids = ms.Tensor(sample["input_ids"][None])
            value, grads = grad_fn(ids, ms.Tensor(lab[None]), weight, *vision)
            value_sum += float(value.asnumpy())
            arrays = [g.asnumpy() * scale for g in grads]
            total = arrays if total is None else [a + b for a, b in zip(total, arrays, strict=True)]
        losses.append(value_sum)
    return losses, {p.name: g for p, g in zip(params, total, strict=True)}


def text_samples(lengths, seed: int = 0) -> list[dict]:
    """Text-only samples of ``lengths`` random tokens, the first third of each a prompt
    without labels: rows for packing (``pack`` + ``text_packed_micro_batches``)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, 100, n).astype(np.int32)
        labels = np.append(ids[1:], -100).astype(np.int32)
        labels[: n // 3] = -100  # a prompt carries no loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def text_reference(model, samples: list[dict]) -> tuple[list[float], dict[str, np.ndarray]]:
    """The whole Llama on each sample alone: summed token losses, and the gradients of the
    global per-token mean by name."""
    params = model.trainable_params()
    total_count = sum(int((s["labels"] >= 0).sum()) for s in samples)

    def loss(ids, labels):
        out = model(ids)
        logits = out[0] if isinstance(out, tuple) else out.logits
        return gm.causal_lm_token_loss(logits, labels)[0] / total_count

    grad_fn = ms.value_and_grad(loss, None, params)
    sums, total = [], None
    for s in samples:
        value, grads = grad_fn(ms.Tensor(s["input_ids"][None]), ms.Tensor(s["labels"][None]))
        sums.append(float(value.asnumpy()) * total_count)
        arrays = [g.asnumpy() for g in grads]
        total = arrays if total is None else [a + b for a, b in zip(total, arrays, strict=True)]
    return sums, {p.name: g for p, g in zip(params, total, strict=True)}
