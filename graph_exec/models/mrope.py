"""Qwen2-VL's M-RoPE position ids of one sample, computed on the host with numpy.

The model's ``get_rope_index`` reads token values in a Python loop over device tensors: called
for each sample of each batch it launches kernels and waits for the device every time (on an
accelerator, a synchronisation per sample in the data path). The positions depend only on the
token ids, the attention mask and the images' grids, which the host holds before anything runs,
so :func:`mrope_positions` computes them here by the model's formula (Qwen2-VL's
``get_rope_index``, images only):

- only the tokens under the mask (``mask == 1``) are numbered; a masked-out position gets ``1``
  on all three axes (the model's fill value);
- the ``k``-th image is the ``k``-th run of image tokens among the kept tokens, of length
  ``t · (h / merge) · (w / merge)`` for its grid ``(t, h, w)``;
- text before an image (since the previous image ended) counts on from ``next``, the same on the
  three axes; the image's tokens, in ``(t, h, w)`` row-major order, get
  ``(t_i, h_i, w_i) + next + text_length``; ``next`` is then the largest position so far plus 1;
- text after the last image counts on from ``next``; a sample without images is ``0 … n-1``.

tests/runtime/test_vlm_batch.py compares it with the model's ``get_rope_index``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FILL = 1  #: what the model writes at masked-out positions


def mrope_positions(
    ids: np.ndarray,
    mask: np.ndarray,
    grids: Sequence[tuple[int, int, int]],
    merge: int,
    image_token: int,
) -> np.ndarray:
    """``(3, S)`` int32: the temporal, height and width position of each of the ``S`` tokens of
    ``ids`` (1-D) with ``mask`` (1-D, 1 where the token is the sample's), whose images have
    ``grids`` (each ``(t, h, w)`` in patches, ``h`` and ``w`` multiples of ``merge``) in order.

    Raises ``ValueError`` when the kept tokens hold fewer image-token runs than ``grids``."""
    kept = np.flatnonzero(np.asarray(mask) == 1)
    tokens = np.asarray(ids)[kept]
    pieces: list[np.ndarray] = []
    start, next_position = 0, 0
    for k, (t, h, w) in enumerate(grids):
        found = np.flatnonzero(tokens[start:] == image_token)
        if not len(found):
            raise ValueError(
                f"image {k} of grid {[t, h, w]} has no image token {image_token} after kept token {start}"
            )
        text = int(found[0])
        pieces.append(_text(next_position, text))
        image = np.indices((t, h // merge, w // merge)).reshape(3, -1) + next_position + text
        pieces.append(image)
        next_position = int(image.max()) + 1
        start += text + image.shape[1]
    pieces.append(_text(next_position, len(tokens) - start))
    positions = np.full((3, len(ids)), FILL, np.int32)
    positions[:, kept] = np.concatenate(pieces, axis=1)
    return positions


def _text(first: int, length: int) -> np.ndarray:
    """``(3, length)``: text positions ``first …``, the same on the three axes."""
    return np.broadcast_to(np.arange(first, first + length), (3, length))
