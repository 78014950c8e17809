"""The global gradient norm of the whole model, and clipping by it.

Every rank holds only part of the model's gradients, and some of them more than once across
the mesh, so each parameter must be counted on exactly one rank of its pipeline:

- a stage parameter lives on one pipeline rank: counted there;
- the preprocess gradient lives on pipeline rank 0 (central backward, the fair baseline) or,
  identical after ``GRADreduce``, on every pipeline rank (owner backward): counted on rank 0;
- of a tied pair (:mod:`graph_exec.runtime.tied`) both ranks hold the summed gradient: the
  first name is counted, the second never;
- data-parallel replicas hold the same averaged gradients: each replica computes the norm of
  its own pipeline, and they agree without being summed again.

Each rank reduces its counted gradients to one number (the sum of ``|g| ** p``, or the largest
``|g|`` for ``p = inf``) in one compiled kernel (float32) or one host pass (float64, the CPU
fast path); the numbers of the pipeline's ranks travel in one small vector, each rank writing
only its own slot, through one SUM all-reduce; every rank then combines the vector itself, in
the same order and in float64, so the norm is bit-identical on every rank whatever order the
collective summed in. **The slots carry a float64's bits in an int64** (the CPU backend refuses
float64 collectives): one writer per slot, the others add integer zeros, so every bit of the
share arrives, a NaN included.

Who meets the mesh, and when, is :mod:`graph_exec.runtime.update_gate`'s business (the norm
rides in the same vector as the ranks' failure flags and finiteness); this module holds one
rank's side: what it counts, its share, and the scaling.

**The norm rides with the step's own collective.** A schedule with a loss scaler or per-token
loss already meets its pipeline at the end of every step (:mod:`graph_exec.runtime.step_end`).
Once :meth:`GlobalGradNorm.clip` has been called, the next steps' ends put this rank's share in
that same vector and keep the norm (:meth:`GlobalGradNorm.learn`), so that the first ``clip`` after
the step needs no collective of its own (a second meeting of the ranks cost more than the
arithmetic: see ``docs/performance.md``, "The training loop"). The share is taken before the
step's last factor (unscaling, per-token division), which multiplies the norm exactly as it
multiplies every gradient. What could change the gradients in between — :meth:`forget` is called
for ``zero_grad()`` and ``grads()`` — makes ``clip`` measure afresh; a step whose norm was not
used stops the riding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

#: Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does.
EPSILON = 1e-6


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float: positive, ``inf`` allowed."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or float('inf'), got {norm_type!r}")
    return float(norm_type)


def check_max_norm(max_norm: Any) -> float:
    """``max_norm`` as a float: positive, ``inf`` (only measure) allowed."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(
            f"max_norm must be a positive number or float('inf') to only measure, got {max_norm!r}"
        )
    return float(max_norm)


class NonFiniteGradientWarning(RuntimeWarning):
    """A step's gradients held an infinity or a NaN (no loss scaler): nothing was applied or scaled."""


def warn_non_finite(what: str) -> None:
    """One warning, on every rank: ``what`` happened because a gradient was not finite. Its
    location is the line that called ``step()`` or ``clip_grad_norm()`` (through the update
    gate's call and its refusal: four frames up)."""
    warnings.warn(what, NonFiniteGradientWarning, stacklevel=5)


def norm_slots(part: float, rank: int, count: int) -> np.ndarray:
    """``count`` int64 words, zero but for the float64 bits of ``part`` in slot ``rank``: summed
    over the group (one writer per slot, adding zeros), they hold every rank's share exactly."""
    slots = np.zeros(count, np.float64)
    slots[rank] = part
    return slots.view(np.int64)


def combine(summed: np.ndarray, norm_type: float) -> float:
    """The norm from summed :func:`norm_slots` words, combined on the host in float64, the
    same way on every rank."""
    values = [float(v) for v in np.ascontiguousarray(summed, np.int64).view(np.float64)]
    if math.isinf(norm_type):
        return max(values)
    total = math.fsum(values)
    return math.sqrt(total) if norm_type == 2.0 else total ** (1.0 / norm_type)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``; 1 for a norm that is not finite (nothing scaled)."""
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + EPSILON))


def counted_names(
    trained: Sequence[str], stage_names: Collection[str], pp_rank: int, tied_seconds: Collection[str]
) -> list[str]:
    """The accumulators this rank counts in the global norm, in ``trained`` order: its stage
    parameters, the preprocess ones on pipeline rank 0 only, never the second name of a tied
    pair (see the module docstring)."""
    skipped = set(tied_seconds)
    return [n for n in trained if (n in stage_names or pp_rank == 0) and n not in skipped]


class GlobalGradNorm:
    """One rank's side of the global norm: its counted names, its pipeline's transport.

    ``counted``: the accumulator names this rank counts; ``transport``: the pipeline group's
    (``None`` for a one-rank pipeline); ``rank``/``size``: this rank's place in it.
    """

    def __init__(
        self, executor: Any, counted: Sequence[str], transport: Any | None, rank: int, size: int
    ) -> None:
        self.executor = executor
        self.counted = tuple(counted)
        self._transport = transport
        self._rank = rank
        self._size = size
        #: The norm type the end of step measures along (``None``: none), learnt from ``clip``.
        self._riding: float | None = None
        #: ``(norm type, norm)`` the end of this step measured, until used or forgotten.
        self._known: tuple[float, float] | None = None

    @property
    def slot_count(self) -> int:
        """How many numbers :meth:`slots` puts in a vector (one per pipeline rank)."""
        return self._size if self._transport is not None else 1

    def part(self, norm_type: float) -> float:
        """This rank's share: the sum of ``|g| ** p`` (largest ``|g|``) of what it counts."""
        return float(self.executor.grad_norm_part(self.counted, norm_type).asnumpy())

    def slots(self, part: float) -> np.ndarray:
        """:func:`norm_slots` of ``part`` in this rank's slot of the pipeline."""
        return norm_slots(part, self._rank if self.slot_count > 1 else 0, self.slot_count)

    combine = staticmethod(combine)

    def riding(self) -> float | None:
        """For the end of a step: the norm type to measure along with its collective, or
        ``None``. A norm the last step measured and nobody used stops the riding."""
        if self._known is not None:
            self._riding = None
        self._known = None
        return self._riding

    def learn(self, norm_type: float, norm: float) -> None:
        """The end of step measured ``norm`` (of the gradients as they now are)."""
        self._known = (norm_type, norm)

    def known(self, norm_type: float) -> float | None:
        """The ``norm_type``-norm the end of this step measured, if nothing changed since."""
        return self._known[1] if self._known is not None and self._known[0] == norm_type else None

    def forget(self) -> None:
        """The gradients may have changed: the next clip measures afresh."""
        self._known = None

    def clip(self, norm: float, max_norm: float, norm_type: float) -> None:
        """Scale this rank's gradients (all of them, counted or not) in place by
        :func:`clip_coefficient` of ``norm``, the mesh's ``norm_type``-norm of them; the next
        steps' ends measure that norm type along."""
        self._known = None
        self._riding = norm_type
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient < 1.0:
            self.executor.multiply_grads(coefficient)
