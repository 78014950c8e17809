"""Per-layer and per-call costs fitted from measured stages of launches with different splits.

A stage's forward (and backward) is one compiled call: it costs what its layers cost plus a
fixed part that does not depend on how many layers it holds (the call's dispatch, the send
that follows it). On a small model on a CPU the fixed part is as large as a layer, so
"stage cost over its layer count" makes a two-layer stage (``V = 1``) look twice a one-layer
stage (``V = 2``) when it measured 1.3-1.5x. Stage 0 differs again: it holds the embedding and
sends no gradient back; the last stage fuses forward, loss and backward into one call.

The model, per direction, over every stage but the last:

- stage 0 of ``n`` layers: ``first + n * layer``;
- any other stage: ``chunk + n * layer``;
- the last stage's fused call and the gradient's send after it:
  ``last_extra + n * (layer_forward + layer_backward)``.

``layer`` is told apart from ``chunk`` and ``first`` only where the measured stages hold
different layer counts (a ``V = 1`` launch beside a ``V = 2`` one, an uneven split). Where
they do not, the per-layer cost is the smaller of the two stage groups' per-layer costs, which
keeps both fixed parts at or above zero and reproduces every measured stage.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from graph_exec.simulate import OpCosts


@dataclass(frozen=True)
class StageFit:
    """Fitted costs (the unit of the measured ones)."""

    layer_forward: float
    layer_backward: float
    chunk_forward: float  #: a stage other than the first and last, besides its layers
    chunk_backward: float
    first_forward: float  #: stage 0, besides its layers (its call, the embedding)
    first_backward: float
    #: The last stage's fused call and its gradient's send, besides its layers' forward and backward.
    last_extra: float


@dataclass(frozen=True)
class MeasuredSplit:
    """One launch's measured per-stage costs and its split (decoder layers per stage)."""

    costs: OpCosts
    layers: tuple[int, ...]


def fit_stages(runs: Sequence[MeasuredSplit]) -> StageFit:
    """The model of the module docstring fitted (least squares) to every stage of ``runs``."""
    if not runs:
        raise ValueError("fit_stages needs at least one measured launch")
    for run in runs:
        if len(run.layers) < 2 or len(run.costs.stage_forward) != len(run.layers):
            raise ValueError(
                f"a launch needs at least 2 stages with one cost each; got the split {list(run.layers)} "
                f"and {len(run.costs.stage_forward)} stage costs"
            )
    layer_f, chunk_f, first_f = _fit_direction(runs, lambda c, s: c.forward_at(s))
    layer_b, chunk_b, first_b = _fit_direction(runs, lambda c, s: c.backward_at(s))
    last = statistics.fmean(  # its F is the fused call, its B the gradient's send
        r.costs.forward_at(len(r.layers) - 1)
        + r.costs.backward_at(len(r.layers) - 1)
        - r.layers[-1] * (layer_f + layer_b)
        for r in runs
    )
    return StageFit(layer_f, layer_b, chunk_f, chunk_b, first_f, first_b, max(last, 0.0))


def _fit_direction(runs: Sequence[MeasuredSplit], cost) -> tuple[float, float, float]:
    """``(layer, chunk, first)`` of one direction over the non-last stages of ``runs``."""
    first = [(r.layers[0], cost(r.costs, 0)) for r in runs]
    middle = [(r.layers[s], cost(r.costs, s)) for r in runs for s in range(1, len(r.layers) - 1)]
    rows = [(n, 0.0, 1.0) for n, _ in first] + [(n, 1.0, 0.0) for n, _ in middle]
    values = [v for _, v in first] + [v for _, v in middle]
    matrix = np.array(rows, dtype=float)
    if not middle:
        matrix = matrix[:, [0, 2]]
    solution, _, rank, _ = np.linalg.lstsq(matrix, np.array(values), rcond=None)
    if rank == matrix.shape[1]:
        layer, *fixed = (float(x) for x in solution)
        chunk, first_fixed = (fixed[0], fixed[1]) if middle else (0.0, fixed[0])
        if min(layer, chunk, first_fixed) >= 0:
            return layer, chunk, first_fixed
    # one layer count per group (or a noisy fit below zero): the smaller per-layer cost
    groups = [[v / n for n, v in group if n > 0] for group in (first, middle)]
    layer = max(min((statistics.fmean(g) for g in groups if g), default=0.0), 0.0)
    chunk = statistics.fmean(v - n * layer for n, v in middle) if middle else 0.0
    first_fixed = statistics.fmean(v - n * layer for n, v in first)
    return layer, max(chunk, 0.0), max(first_fixed, 0.0)
