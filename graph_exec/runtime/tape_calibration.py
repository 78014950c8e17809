"""What MindSpore's autograd tape keeps for each local stage, measured at run time, and the
per-rank peak the plan predicts with it (issue 53, part 1).

The library's own account (:mod:`graph_exec.runtime.memory_account`) sees only the tensors at a
stage's boundary; a recorded forward also keeps every layer's saved activations inside the tape.
With ``measure_tape=True`` the runtime measures them once per stage, on the first step's first
forward of that stage (the real micro-batch shapes): memory in use
(:func:`graph_exec.device.memory_in_use`: the allocator where the device keeps one, else RSS)
grown per held forward under the tape, minus the same forwards run untaped with their outputs
held the same way. Several forwards are held at once and the median growth from the third on is
taken: the first ones may land in memory the allocator already holds (and compile), and RSS moves
in blocks. Nothing is freed between the untaped and the taped forwards, so no freed memory is
reused. The calibration forwards are released (without touching any gradient) before the step
goes on; their cost is a few forwards per stage on the first step.

The tape is measured recorded even with ``recompute=True`` (the executor then keeps only inputs,
but its backward records the forward again, one stage at a time). With ``body="zb"`` the stage's
forward is the split one, so the measure is what it keeps for ``I`` and ``W`` (the linear layers'
saved inputs); what ``I`` then holds for ``W`` is the library's own count (``held_weight_gradients``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping
from typing import Any

from graph_exec.schedule.memory import ItemSizes, peak_bytes
from graph_exec.schedule.plan import Plan

#: Forwards held per measurement (taped and untaped each); the growth is the median from the third.
FORWARDS = 4
#: Micro-batch keys of the calibration forwards (no real micro-batch is negative).
_KEYS = tuple(-1 - k for k in range(FORWARDS))


def _growth(forward: Any) -> tuple[float, list[Any]]:
    """Median growth of memory in use per call of ``forward(k)``, ``k < FORWARDS``, every result
    held, from the third call on; and the results (the caller decides when they go)."""
    from graph_exec.device import memory_in_use, wait_for

    held, seen = [], []
    for k in range(FORWARDS):
        held.append(forward(k))
        wait_for(held[-1])
        seen.append(memory_in_use())
    return float(statistics.median(b - a for a, b in itertools.pairwise(seen[1:]))), held


def measure_stage_tape(executor: Any, stage: int, inputs: tuple[Any, ...]) -> int:
    """Bytes one recorded forward of ``stage`` on ``inputs`` keeps beyond its inputs and outputs
    (0 when nothing is recorded: no trained weight and no input gradient)."""
    recompute = executor.recompute
    executor.recompute = False  # the tape a recompute's backward records is the same one
    try:
        taped, _ = _growth(lambda k: executor.stage_forward(stage, _KEYS[k], inputs))
        plain, _ = _growth(lambda k: executor.stage_forward_only(stage, inputs))
    finally:
        executor.recompute = recompute
        for key in _KEYS:
            executor.release_forward(stage, key)
    return max(0, round(taped - plain))


class TapeCalibration:
    """The measured tape per local stage and the memory in use when the first step began (the
    framework, the parameters, the gradient accumulators and whatever the caller made before)."""

    def __init__(self) -> None:
        self.tapes: dict[int, int] = {}
        self.base_in_use: int | None = None

    def begin_step(self) -> None:
        """Note the memory in use before the first step."""
        from graph_exec.device import memory_in_use

        if self.base_in_use is None:
            self.base_in_use = memory_in_use()

    def before_forward(self, executor: Any, stage: int, inputs: tuple[Any, ...]) -> None:
        """Measure ``stage``'s tape on its first forward's inputs (once per stage)."""
        if stage not in self.tapes:
            self.tapes[stage] = measure_stage_tape(executor, stage, inputs)


def tape_peak(plan: Plan, rank: int, tapes: Mapping[int, int], recompute: bool) -> int:
    """The most tape bytes ``rank`` holds at once under ``plan``: each held forward its stage's
    tape (the plan's memory model says which are held when); with ``recompute`` none is held,
    but a backward records one stage again: the largest."""
    if recompute:
        return max(tapes.values(), default=0)
    return peak_bytes(plan, rank, ItemSizes(activations=dict(tapes), stage_inputs={}))


def tape_stats(
    calibration: TapeCalibration | None, plan: Plan, rank: int, recompute: bool, held_peak: int
) -> dict[str, Any]:
    """``stats()["memory"]``'s tape keys: ``tape_bytes_per_micro`` (measured per local stage),
    ``tape_peak`` (held at once, from the plan), ``base_in_use`` (memory in use before the first
    step), ``predicted_parts`` (each part of the prediction by name, so a miss can be traced to
    the part that caused it: ``base_in_use``, the library's ``held`` peak, the ``tape`` peak) and
    ``predicted_peak`` (their sum), to set beside ``peak_rss`` / ``allocator_peak``; all ``None``
    without ``measure_tape=True``."""
    keys = ("tape_bytes_per_micro", "tape_peak", "base_in_use", "predicted_parts", "predicted_peak")
    if calibration is None or calibration.base_in_use is None:
        return dict.fromkeys(keys)
    peak = tape_peak(plan, rank, calibration.tapes, recompute)
    parts = {"base_in_use": calibration.base_in_use, "held": held_peak, "tape": peak}
    return {
        "tape_bytes_per_micro": dict(sorted(calibration.tapes.items())),
        "tape_peak": peak,
        "base_in_use": calibration.base_in_use,
        "predicted_parts": parts,
        "predicted_peak": sum(parts.values()),
    }
