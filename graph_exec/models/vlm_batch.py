"""Batches of real Qwen2-VL samples: each its own images (0..k, each its own size) and text length.

:func:`vlm_batch` turns a list of samples into the batch-first pipeline input of a Qwen2-VL
split made without a fixed ``image_grid`` (:class:`~graph_exec.models.chunks.VisionBatchPreprocess`):

=====================  ===================  ==================================================
``pixel_values``       (B, P, C·T·p·p) f32  each sample's images' patches in order, then zeros
``patch_image``        (B, P) int32         which of the sample's images a patch belongs to,
                                            ``-1`` on padding (the tower's block-diagonal mask)
``patch_positions``    (B, P, 2) int32      each patch's (row, column) in its image's grid,
                                            as the model's ``rot_pos_emb`` orders them
``input_ids``          (B, S) int32         the text, padded with ``pad_token_id``
``position_ids``       (B, 3, S) int32      M-RoPE positions by ``get_rope_index``'s formula
                                            with the mask, on the host (:mod:`.mrope`)
``attention_mask``     (B, S) int32         1 on the sample's tokens, 0 on padding
=====================  ===================  ==================================================

and the labels ``(B, S)`` int32 (``-100`` on padding). ``P`` is the batch's largest patch
count (at least ``merge²``, so a text-only batch still has one merger row), or a bucket of
``patch_pad_to``; ``S`` the longest sample, or a bucket of ``pad_to``. Everything that reads
token or grid values (the M-RoPE index, the rotary positions, the per-image bounds) is computed
here, on the host with numpy (no device call per sample): what the compiled tower sees are tensors, so one compiled graph serves any mix
of images of the same padded shape (``docs/models.md``, "Masks, padding, placement").

Every sample is checked before anything runs (so before any rank communicates): each error names
the sample, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from graph_exec.models.inputs import image_patches
from graph_exec.models.loss import IGNORE_INDEX
from graph_exec.models.mrope import mrope_positions


class VLMBatch(NamedTuple):
    """What :func:`vlm_batch` returns: ``sched.run(*batch.inputs, labels=batch.labels)``; a list
    of them (:func:`vlm_micro_batches`): ``sched.run(micro_batches=batches)``."""

    inputs: tuple[np.ndarray, ...]  #: pixel_values, patch_image, patch_positions, ids, positions, mask
    labels: np.ndarray  #: (B, S) int32, -100 where nothing is predicted

    @property
    def patches(self) -> np.ndarray:
        """``(B,)``: each sample's real patch count (padding excluded), what its tower costs:
        summed per micro-batch, the cost ``tower_order="balanced"`` places by."""
        return (self.inputs[1] >= 0).sum(axis=1)


class _Vision(NamedTuple):
    """The vision facts of a Qwen2-VL config that a batch depends on."""

    patch: int
    temporal: int
    merge: int
    channels: int
    image_token: int
    start_token: int
    end_token: int

    @property
    def row(self) -> int:  # values per patch row
        return self.channels * self.temporal * self.patch * self.patch


def _vision_of(config: Any) -> _Vision:
    v = config.vision_config
    return _Vision(
        v.patch_size,
        v.temporal_patch_size,
        v.spatial_merge_size,
        v.in_channels,
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )


def _numpy(value: Any) -> np.ndarray:
    return value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)


def _bucket(length: int, pad_to: int | Sequence[int] | None, what: str, option: str) -> int:
    """``length`` itself (no ``pad_to``), or the smallest of ``pad_to``'s sizes that holds it."""
    if pad_to is None:
        return length
    sizes = (pad_to,) if isinstance(pad_to, int) else tuple(pad_to)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"{option} must be a positive int or increasing positive ints, got {pad_to!r}")
    for size in sorted(sizes):
        if length <= size:
            return size
    raise ValueError(f"{what} is above the largest {option} size {max(sizes)} ({option}={pad_to!r})")


def rotary_positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """``(t·h·w, 2)``: each patch's (row, column) in the order of the model's ``rot_pos_emb``
    (each ``merge × merge`` block adjacent, then tiled over ``t``): the rows of the rotary
    frequency table the model reads for this image."""
    t, h, w = grid
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w))
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w))

    def blocked(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    return np.tile(np.stack([blocked(rows), blocked(cols)], axis=-1), (t, 1)).astype(np.int32)


def place_images(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], row: int, images: Sequence[Image], merge: int
) -> None:
    """Write ``images`` (their patches and grids, in order) into row ``row`` of the batch's
    ``(pixel_values, patch_image, patch_positions)``: each image's patches after the previous
    one's, numbered by its place in the row, with its M-RoPE patch positions."""
    pixel_values, patch_image, patch_positions = arrays
    at = 0
    for k, (patches, grid) in enumerate(images):
        pixel_values[row, at : at + len(patches)] = patches
        patch_image[row, at : at + len(patches)] = k
        patch_positions[row, at : at + len(patches)] = rotary_positions(grid, merge)
        at += len(patches)


def _image(image: Any, v: _Vision, where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image's ``(patches, grid)``: a ``(C, H, W)`` array, or ``{"pixel_values": (P, row),
    "grid_thw": (t, h, w)}`` already processed."""
    unit = v.patch * v.merge
    if isinstance(image, Mapping):
        if set(image) != {"pixel_values", "grid_thw"}:
            raise ValueError(
                f"{where}: a processed image is {{'pixel_values', 'grid_thw'}}, got keys {sorted(image)}"
            )
        patches = _numpy(image["pixel_values"]).astype(np.float32)
        grid = tuple(int(n) for n in _numpy(image["grid_thw"]).reshape(-1))
        if len(grid) != 3 or min(grid) < 1 or grid[1] % v.merge or grid[2] % v.merge:
            raise ValueError(
                f"{where}: grid_thw {list(grid)} must be 3 positive ints with h and w multiples of "
                f"spatial_merge_size {v.merge}"
            )
        want = (grid[0] * grid[1] * grid[2], v.row)
        if patches.shape != want:
            raise ValueError(
                f"{where}: pixel_values has shape {list(patches.shape)}, but grid_thw {list(grid)} needs {list(want)}"
            )
        return patches, grid  # type: ignore[return-value]
    pixels = _numpy(image).astype(np.float32)
    if pixels.ndim != 3 or pixels.shape[0] != v.channels:
        raise ValueError(f"{where}: an image is ({v.channels}, H, W), got shape {list(pixels.shape)}")
    _, height, width = pixels.shape
    if height < unit or width < unit or height % unit or width % unit:
        raise ValueError(
            f"{where}: image size {height}x{width} is not a multiple of patch_size x spatial_merge_size = "
            f"{unit} (allowed: {unit}x{unit}, {unit}x{2 * unit}, {2 * unit}x{2 * unit}, ...)"
        )
    patches = image_patches(pixels[None], v.patch, v.temporal, v.merge)[0]
    return patches, (1, height // v.patch, width // v.patch)


def _check_tokens(ids: np.ndarray, grids: list[tuple[int, int, int]], v: _Vision, where: str) -> None:
    """The sample's image tokens are, per image in order, ``<vision_start>`` then ``t·h·w/merge²``
    image tokens then ``<vision_end>``, as Qwen2-VL's processor writes them."""
    need = [t * h * w // v.merge**2 for t, h, w in grids]
    is_image = ids == v.image_token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    got = [length for _, length in runs]
    framed = all(
        start > 0
        and ids[start - 1] == v.start_token
        and start + n < len(ids)
        and ids[start + n] == v.end_token
        for start, n in runs
    )
    if got != need or not framed:
        raise ValueError(
            f"{where}: input_ids has {int(is_image.sum())} image tokens in runs {got}, but its "
            f"{len(grids)} image(s) of grids {[list(g) for g in grids]} need runs {need} (t*h*w/"
            f"{v.merge}^2 each), each between vision start {v.start_token} and vision end {v.end_token}"
        )


def default_labels(ids: np.ndarray, image_token: int) -> np.ndarray:
    """``labels[i] = ids[i + 1]`` (aligned: position ``i`` predicts the next token), ``-100`` at
    the last position and where the next token is an image placeholder."""
    labels = np.full(ids.shape, IGNORE_INDEX, np.int32)
    labels[:-1] = ids[1:]
    labels[:-1][ids[1:] == image_token] = IGNORE_INDEX
    return labels


Image = tuple[np.ndarray, tuple[int, int, int]]  #: one image's (patches, grid)


def checked_sample(sample: Any, v: _Vision, where: str) -> tuple[np.ndarray, np.ndarray, list[Image]]:
    """``(input_ids, labels, images)`` of one sample, checked (errors start with ``where``)."""
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        raise ValueError(f"{where}: a sample is a dict with 'input_ids' (and 'labels', 'images')")
    ids = _numpy(sample["input_ids"])
    if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{where}: input_ids must be a non-empty 1-D integer array, got shape {list(ids.shape)}"
        )
    ids = ids.astype(np.int32)
    images = sample.get("images") or []
    made = [_image(image, v, f"{where} image {i}") for i, image in enumerate(images)]
    _check_tokens(ids, [g for _, g in made], v, where)
    label = sample.get("labels")
    label = default_labels(ids, v.image_token) if label is None else _numpy(label).astype(np.int32)
    if label.shape != ids.shape:
        raise ValueError(f"{where}: labels has shape {list(label.shape)}, input_ids {list(ids.shape)}")
    return ids, label, made


def vlm_batch(
    split_or_model: Any,
    samples: Sequence[Mapping[str, Any]],
    *,
    pad_to: int | Sequence[int] | None = None,
    patch_pad_to: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> VLMBatch:
    """The pipeline input and labels of ``samples`` for a Qwen2-VL split without ``image_grid``.

    Args:
        split_or_model: the :class:`~graph_exec.models.SplitModel` (its ``model``) or the whole
            mindone ``Qwen2VLForConditionalGeneration``: its config.
        samples: dicts with ``input_ids`` (1-D, the image tokens of its images in place),
            optionally ``labels`` (1-D, aligned with ``input_ids``: ``labels[i]`` is the token
            after position ``i``; default :func:`default_labels`) and ``images``: a list of
            ``(C, H, W)`` arrays (``H``, ``W`` multiples of patch × merge) or processed
            ``{"pixel_values": (t·h·w, C·T·p·p), "grid_thw": (t, h, w)}``.
        pad_to: the padded text length: ``None`` (the longest sample), an int, or increasing
            bucket sizes (the smallest that holds the longest sample): a bounded set of shapes.
        patch_pad_to: the same for the patch count.
        pad_token_id: the token id of text padding (never the image token).

    Raises ``ValueError`` naming the sample and the value: an image whose size is not a multiple
    of patch × merge, image tokens that do not match the sample's images, labels of another
    length, a sample longer than ``pad_to`` allows.
    """
    model = _model_of(split_or_model)
    _check_samples(samples, model, pad_token_id)
    return _padded_batch(model, samples, 0, pad_to, patch_pad_to, pad_token_id)


def vlm_micro_batches(
    split_or_model: Any,
    samples: Sequence[Mapping[str, Any]],
    micro: int,
    *,
    pad_to: int | Sequence[int] | None = None,
    patch_pad_to: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> list[VLMBatch]:
    """``samples`` cut into ``micro`` consecutive groups, each made by :func:`vlm_batch` on its
    own: ``sched.run(micro_batches=vlm_micro_batches(split, samples, M), tower_costs=...)``.

    One batch cut on dim 0 pads every micro-batch to the *whole* batch's largest patch count and
    longest text, so a micro-batch of small images runs the tower at the heaviest one's shape.
    Here each micro-batch is padded only to its own (or to its own bucket of ``pad_to`` /
    ``patch_pad_to``): its tower computes what its real patches cost, which is what
    :func:`vlm_tower_costs` reports and ``tower_order="balanced"`` places by. The arguments are
    :func:`vlm_batch`'s; ``len(samples)`` must be a multiple of ``micro``. Errors name the sample
    by its index in ``samples``.
    """
    model = _model_of(split_or_model)
    _check_samples(samples, model, pad_token_id)
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"micro must be a positive int (the number of micro-batches), got {micro!r}")
    if len(samples) % micro:
        raise ValueError(
            f"{len(samples)} samples cannot be cut into {micro} equal micro-batches: pass a multiple "
            f"of {micro} samples"
        )
    rows = len(samples) // micro
    return [
        _padded_batch(model, samples[m * rows : (m + 1) * rows], m * rows, pad_to, patch_pad_to, pad_token_id)
        for m in range(micro)
    ]


def vlm_tower_costs(batches: Sequence[VLMBatch], per_patch: float = 1.0) -> list[float]:
    """Each micro-batch's tower cost for ``run(..., tower_costs=...)``: its real patches (padding
    excluded, :attr:`VLMBatch.patches` summed) times ``per_patch``, one patch's tower forward in
    units of one chunk forward (measured, e.g. by ``graph-exec bench qwen2vl --tower-ratio``'s
    calibration). The placement weighs these costs against a transfer and the slack between
    chunk forwards, so raw patch counts (the default ``per_patch=1.0``) rank the micro-batches
    right but overstate the towers against those. With
    :func:`vlm_micro_batches` this is also what each tower computes, since each micro-batch is
    padded to its own patch count only."""
    return [float(batch.patches.sum()) * per_patch for batch in batches]


def _model_of(split_or_model: Any) -> Any:
    """The whole mindone model of a :class:`~graph_exec.models.SplitModel`, or the model itself."""
    from graph_exec.models.split import SplitModel

    return split_or_model.model if isinstance(split_or_model, SplitModel) else split_or_model


def _check_samples(samples: Any, model: Any, pad_token_id: int) -> None:
    if isinstance(samples, Mapping) or not isinstance(samples, Sequence) or not samples:
        raise ValueError(f"samples must be a non-empty list of dicts, got {type(samples).__name__}")
    if pad_token_id == _vision_of(model.config).image_token:
        raise ValueError(f"pad_token_id {pad_token_id} is the image token: choose another")


def _padded_batch(
    model: Any,
    samples: Sequence[Mapping[str, Any]],
    first: int,
    pad_to: int | Sequence[int] | None,
    patch_pad_to: int | Sequence[int] | None,
    pad_token_id: int,
) -> VLMBatch:
    """:func:`vlm_batch` of checked ``samples``, whose first is sample ``first`` in errors."""
    v = _vision_of(model.config)
    texts, labels, patches = [], [], []
    for k, sample in enumerate(samples):
        ids, label, made = checked_sample(sample, v, f"sample {first + k}")
        texts.append(ids)
        labels.append(label)
        patches.append(made)
    counts = [sum(len(p) for p, _ in made) for made in patches]
    longest = max(range(len(texts)), key=lambda k: len(texts[k]))
    length = _bucket(
        len(texts[longest]),
        pad_to,
        f"sample {first + longest} has {len(texts[longest])} tokens, which",
        "pad_to",
    )
    most = max(range(len(counts)), key=lambda k: counts[k])
    num_patches = _bucket(
        max(counts[most], v.merge**2),
        patch_pad_to,
        f"sample {first + most} has {counts[most]} patches, which",
        "patch_pad_to",
    )
    if num_patches % v.merge**2:
        raise ValueError(
            f"patch_pad_to sizes must be multiples of spatial_merge_size^2 = {v.merge**2}, got {num_patches}"
        )
    batch = len(samples)
    pixel_values = np.zeros((batch, num_patches, v.row), np.float32)
    patch_image = np.full((batch, num_patches), -1, np.int32)
    patch_positions = np.zeros((batch, num_patches, 2), np.int32)
    input_ids = np.full((batch, length), pad_token_id, np.int32)
    mask = np.zeros((batch, length), np.int32)
    target = np.full((batch, length), IGNORE_INDEX, np.int32)
    for b, made in enumerate(patches):
        place_images((pixel_values, patch_image, patch_positions), b, made, v.merge)
        n = len(texts[b])
        input_ids[b, :n], mask[b, :n], target[b, :n] = texts[b], 1, labels[b]
    positions = np.stack(
        [
            mrope_positions(input_ids[b], mask[b], [g for _, g in made], v.merge, v.image_token)
            for b, made in enumerate(patches)
        ]
    )
    inputs = (pixel_values, patch_image, patch_positions, input_ids, positions, mask)
    return VLMBatch(inputs, target)
