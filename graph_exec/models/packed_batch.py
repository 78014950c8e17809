"""Packed rows: several samples per row, each attending only to itself.

The micro-batches of a :class:`graph_exec.data.packing.Packing` as pipeline inputs. They have
the layout of the padded batches (:mod:`.vlm_batch` for Qwen2-VL, ``(input_ids, position_ids,
attention_mask)`` for a Llama/Qwen2 split made with ``packed=True``), with two differences:

- ``attention_mask`` holds segment ids: ``k + 1`` on the tokens of the row's ``k``-th sample,
  ``0`` on padding. The chunks build a block-diagonal causal mask from it
  (:func:`graph_exec.models.chunks.padded_causal_mask`): a token reads the earlier tokens of its
  own sample only. A 0/1 mask is the one-sample case, so padded batches are unchanged.
- positions restart at each sample: ``0 …`` for text, and for Qwen2-VL the M-RoPE positions of
  the model's own formula computed on each sample alone (:func:`.mrope.mrope_positions`).

A row's images are its samples' images in order (``patch_image`` numbers them along the row, so
the tower's per-image attention is as before), and the labels are each sample's own (its last
position ``-100``), so no sample predicts the next one's first token. Every row is padded to
``max_length`` and the patches to a bucket of ``patch_pad_to``: a new packing reuses the
compiled shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graph_exec.data.packing import Packing, SampleCost
from graph_exec.models.loss import IGNORE_INDEX
from graph_exec.models.mrope import FILL, mrope_positions
from graph_exec.models.vlm_batch import (
    VLMBatch,
    _bucket,
    _check_samples,
    _model_of,
    _vision_of,
    checked_sample,
    place_images,
)


def vlm_sample_costs(split_or_model: Any, samples: Sequence[Mapping[str, Any]]) -> list[SampleCost]:
    """Each Qwen2-VL sample's :class:`SampleCost`: tokens, patches, and its images' tokens
    (``t·h·w / merge²`` each, framed by vision start and end)."""
    model = _model_of(split_or_model)
    _check_samples(samples, model, -1)
    v = _vision_of(model.config)
    costs = []
    for k, sample in enumerate(samples):
        ids, _, made = checked_sample(sample, v, f"sample {k}")
        patches = sum(len(p) for p, _ in made)
        costs.append(SampleCost(len(ids), patches, patches // v.merge**2 + 2 * len(made)))
    return costs


def text_sample_costs(samples: Sequence[Mapping[str, Any]]) -> list[SampleCost]:
    """Each text-only sample's :class:`SampleCost` (its length)."""
    return [SampleCost(len(s["input_ids"])) for s in samples]


def vlm_packed_micro_batches(
    split_or_model: Any,
    samples: Sequence[Mapping[str, Any]],
    packing: Packing,
    max_length: int,
    *,
    patch_pad_to: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> list[VLMBatch]:
    """The micro-batches of ``packing`` (of ``samples``) for a Qwen2-VL split without
    ``image_grid``: ``sched.run(micro_batches=...)``. Errors name samples by their index."""
    model = _model_of(split_or_model)
    _check_samples(samples, model, pad_token_id)
    v = _vision_of(model.config)
    checked = [checked_sample(s, v, f"sample {k}") for k, s in enumerate(samples)]
    return [
        _vlm_micro(mb, checked, v, max_length, patch_pad_to, pad_token_id) for mb in packing.micro_batches
    ]


def _vlm_micro(
    rows: Sequence[Sequence[int]],
    checked: list,
    v: Any,
    max_length: int,
    patch_pad_to: int | Sequence[int] | None,
    pad_token_id: int,
) -> VLMBatch:
    ids, segments, labels, _ = _text_rows(rows, [(c[0], c[1]) for c in checked], max_length, pad_token_id)
    positions = np.full((len(rows), 3, max_length), FILL, np.int32)
    counts = []
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(checked[i][0])
            grids = [g for _, g in checked[i][2]]
            ones = np.ones(n, np.int32)
            positions[b, :, at : at + n] = mrope_positions(checked[i][0], ones, grids, v.merge, v.image_token)
            at += n
        counts.append(sum(len(p) for i in row for p, _ in checked[i][2]))
    most = int(np.argmax(counts))
    num_patches = _bucket(
        max(counts[most], v.merge**2),
        patch_pad_to,
        f"packed row {most} has {counts[most]} patches, which",
        "patch_pad_to",
    )
    pixel_values = np.zeros((len(rows), num_patches, v.row), np.float32)
    patch_image = np.full((len(rows), num_patches), -1, np.int32)
    patch_positions = np.zeros((len(rows), num_patches, 2), np.int32)
    for b, row in enumerate(rows):
        images = [made for i in row for made in checked[i][2]]
        place_images((pixel_values, patch_image, patch_positions), b, images, v.merge)
    return VLMBatch((pixel_values, patch_image, patch_positions, ids, positions, segments), labels)


def text_packed_micro_batches(
    samples: Sequence[Mapping[str, Any]], packing: Packing, max_length: int, *, pad_token_id: int = 0
) -> list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]]:
    """The micro-batches of ``packing`` for a Llama/Qwen2 split made with ``packed=True``:
    ``((input_ids, position_ids, attention_mask), labels)`` each, positions ``0 …`` per sample."""
    pairs = []
    for k, s in enumerate(samples):
        if s.get("images"):
            raise ValueError(
                f"sample {k} has images: a text-only packing takes none (use vlm_packed_micro_batches)"
            )
        ids = np.asarray(s["input_ids"], np.int32)
        pairs.append((ids, np.asarray(s["labels"], np.int32)))
    out = []
    for mb in packing.micro_batches:
        ids, segments, labels, positions = _text_rows(mb, pairs, max_length, pad_token_id)
        out.append(((ids, positions, segments), labels))
    return out


def _text_rows(
    rows: Sequence[Sequence[int]],
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    max_length: int,
    pad_token_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, segments, labels, positions)`` (B, max_length) of ``rows`` of ``(ids, labels)``
    ``pairs``: each sample after the previous, positions ``0 …`` per sample."""
    shape = (len(rows), max_length)
    ids = np.full(shape, pad_token_id, np.int32)
    segments = np.zeros(shape, np.int32)
    labels = np.full(shape, IGNORE_INDEX, np.int32)
    positions = np.zeros(shape, np.int32)
    for b, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            sample_ids, sample_labels = pairs[i]
            n = len(sample_ids)
            if at + n > max_length:
                raise ValueError(
                    f"packed row {b} holds {at + n} tokens (sample {i} included), above max_length {max_length}"
                )
            ids[b, at : at + n], labels[b, at : at + n] = sample_ids, sample_labels
            segments[b, at : at + n] = k + 1
            positions[b, at : at + n] = np.arange(n)
            at += n
    return ids, segments, labels, positions
