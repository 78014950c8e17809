"""The image mixes of ``graph-exec bench qwen2vl --image-mix uniform|skewed``, defined by cost.

A mix says which micro-batches of a step are *heavy* (their samples' images have
:data:`HEAVY_FACTOR` times the patches of a light one) and how deep the vision tower is, so that
it means the same on any machine:

- ``skewed``: per step, :func:`heavy_count` of the ``M`` micro-batches are heavy (one in
  :data:`HEAVY_EVERY`, at least one: heavy samples are rare), at positions drawn from a generator
  seeded by the step (the same on every rank, so every rank reaches the same placement). A
  micro-batch's tower cost is its samples' patches, so the costs within a step vary
  :data:`HEAVY_FACTOR` x.
- ``uniform``: every micro-batch light, every one the same cost.

In both, the tower depth is calibrated (as ``--tower-ratio`` does, from the start-up costs of a
light micro-batch) so that the *mean* tower forward per micro-batch is :data:`MEAN_RATIO` x one
chunk's forward: :func:`light_ratio` is the ratio a light micro-batch must have.

Pure numbers, no MindSpore: the parent calibrates with it and the ranks draw with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: The accepted ``--image-mix`` values.
MIXES = ("uniform", "skewed")
#: The mean tower forward per micro-batch, in chunk forwards.
MEAN_RATIO = 2.0
#: A heavy image's patches over a light one's (the spread of micro-batch costs within a step).
HEAVY_FACTOR = 4
#: One heavy micro-batch per this many (rounded down, at least one) in a skewed step.
HEAVY_EVERY = 4


def check_mix(mix: str) -> str:
    if mix not in MIXES:
        raise ValueError(f"image mix must be one of {MIXES}, got {mix!r}")
    return mix


def light_side(image: int) -> tuple[int, int]:
    """A light image: the preset's own ``image`` x ``image`` pixels (what the calibration measures)."""
    return (image, image)


def heavy_side(image: int) -> tuple[int, int]:
    """A heavy image: :data:`HEAVY_FACTOR` x the light one's patches (twice the side)."""
    side = round(image * HEAVY_FACTOR**0.5)
    return (side, side)


def heavy_count(mix: str, micro: int) -> int:
    """How many of a step's ``micro`` micro-batches are heavy."""
    return 0 if check_mix(mix) == "uniform" else max(1, micro // HEAVY_EVERY)


def heavy_micros(mix: str, micro: int, step: int) -> tuple[bool, ...]:
    """Per micro-batch of step ``step``: whether it is heavy (the same draw on every rank)."""
    heavy = set(np.random.default_rng((step, 40)).permutation(micro)[: heavy_count(mix, micro)].tolist())
    return tuple(m in heavy for m in range(micro))


def micro_weights(mix: str, micro: int, step: int) -> tuple[float, ...]:
    """Per micro-batch: its tower cost in light micro-batches (1 or :data:`HEAVY_FACTOR`)."""
    return tuple(float(HEAVY_FACTOR if h else 1) for h in heavy_micros(mix, micro, step))


def mean_weight(mix: str, micro: int) -> float:
    """The mean of :func:`micro_weights` over a step (the same for every step)."""
    heavy = heavy_count(mix, micro)
    return (micro - heavy + heavy * HEAVY_FACTOR) / micro


def light_ratio(mix: str, micro: int) -> float:
    """The tower ratio (tower forward / chunk forward) of a *light* micro-batch that makes the
    mean micro-batch's :data:`MEAN_RATIO`."""
    return MEAN_RATIO / mean_weight(mix, micro)


def image_sizes(mix: str, micro: int, rows: int, step: int, image: int) -> list[tuple[int, int]]:
    """One image size per sample of step ``step`` (``micro`` x ``rows`` samples, micro-batch by
    micro-batch): every sample of a heavy micro-batch has a heavy image, the others a light one."""
    light, heavy = light_side(image), heavy_side(image)
    return [heavy if h else light for h in heavy_micros(mix, micro, step) for _ in range(rows)]


def spread(weights: Sequence[float]) -> float:
    """The largest over the smallest micro-batch cost of a step."""
    return max(weights) / min(weights)
