"""Batches for split models: what the first stage (or the preprocess) of a split model takes.

A language model's pipeline input is ``(input_ids, position_ids)``, both ``(B, S)`` int32. A
Qwen2-VL pipeline input is ``(pixel_values, input_ids, position_ids)``: one image per sample,
its patches ``(B, patches, C·T·P·P)``, and the M-RoPE position ids batch first, ``(B, 3, S)``,
computed here by the model's own ``get_rope_index`` (eagerly: it reads token values, which a
compiled graph cannot). Every array is batch first, so that the schedules cut a batch into
micro-batches on dim 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _numpy(value: Any) -> np.ndarray:
    return value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)


def lm_inputs(input_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, position_ids)`` of a batch of ``(B, S)`` token ids (positions ``0 … S-1``)."""
    ids = _numpy(input_ids).astype(np.int32)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {ids.shape}")
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    return ids, positions


def vlm_inputs(model: Any, input_ids: Any, pixel_values: Any, image_grid_thw: Any) -> tuple[np.ndarray, ...]:
    """``(pixel_values, input_ids, position_ids)`` for a split Qwen2-VL ``model``.

    ``input_ids`` (B, S) with each sample's image tokens, ``pixel_values`` as Qwen2-VL's
    processor makes them (all images' patches, ``(B · patches, C·T·P·P)``) and
    ``image_grid_thw`` (B, 3), one image per sample, every image the same grid.
    """
    import mindspore as ms

    ids = _numpy(input_ids).astype(np.int32)
    grid = _numpy(image_grid_thw).astype(np.int64)
    pixels = _numpy(pixel_values).astype(np.float32)
    batch = ids.shape[0]
    if grid.shape != (batch, 3) or (grid != grid[0]).any():
        raise ValueError(
            f"image_grid_thw must be ({batch}, 3) with one equal grid per sample (one image each), got "
            f"{grid.tolist()}"
        )
    patches = int(np.prod(grid[0]))
    if pixels.shape[0] != batch * patches:
        raise ValueError(
            f"pixel_values has {pixels.shape[0]} patch rows, but {batch} images of grid {grid[0].tolist()} "
            f"have {batch * patches}"
        )
    positions, _ = model.model.get_rope_index(ms.Tensor(ids), ms.Tensor(grid), None, None)
    positions = positions.asnumpy().astype(np.int32).transpose(1, 0, 2).copy()
    return pixels.reshape(batch, patches, -1), ids, positions


def image_patches(images: Any, patch_size: int, temporal_patch_size: int, merge_size: int) -> np.ndarray:
    """``images`` (B, C, H, W) as Qwen2-VL's image processor lays them out: each image repeated
    over ``temporal_patch_size`` frames and cut into ``patch_size`` squares, the squares of each
    ``merge_size × merge_size`` block adjacent (the order the vision tower's rotary embedding and
    patch merger expect); returns ``(B, (H/p)·(W/p), C·T·p·p)``. The grid of each image is
    ``(1, H / patch_size, W / patch_size)``."""
    pixels = _numpy(images).astype(np.float32)
    batch, channels, height, width = pixels.shape
    p, t, m = patch_size, temporal_patch_size, merge_size
    if height % (p * m) or width % (p * m):
        raise ValueError(
            f"image size {height}x{width} must be a multiple of patch_size x merge_size = {p * m}"
        )
    gh, gw = height // p, width // p
    frames = np.repeat(pixels[:, None], t, axis=1)  # (B, T, C, H, W)
    blocks = frames.reshape(batch, 1, t, channels, gh // m, m, p, gw // m, m, p)
    blocks = blocks.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return blocks.reshape(batch, gh * gw, channels * t * p * p).copy()
