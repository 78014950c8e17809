"""What MindSpore's autograd tape keeps for each local stage, measured at run time, and the
per-rank peak the plan predicts with it (issue 53, part 1).

The library's own account (:mod:`graph_exec.runtime.memory_account`) sees only the tensors at a
stage's boundary; a recorded forward also keeps every layer's saved activations inside the tape.
With ``measure_tape=True`` the runtime measures, once per stage, on the first step's first
forward of that stage (the real micro-batch shapes):

- the tape: memory in use (:func:`graph_exec.device.memory_in_use`: the allocator where the
  device keeps one, else RSS) grown by a second recorded forward held beside the first (the
  first may compile and land in memory the allocator already holds), less the outputs it made
  (the library counts those). Only where the plan holds tapes:
  not for the last stage (its fused step keeps nothing after it) nor with ``recompute=True``.
  With ``body="zb"`` the forward is the split one, so the measure is what it keeps for ``I``
  and ``W``; what ``I`` then holds for ``W`` is the library's own count
  (``held_weight_gradients``);
- the backward transient: the high-water growth of memory in use
  (:func:`graph_exec.device.memory_high_water`) while one backward runs through the executor's
  own path (the last stage: its fused step, loss included; ``recompute``: the rebuilt forward
  included), its accumulated gradients then put back exactly. It runs right after the taped
  forwards: nothing else freed memory into the pool just before, which the backward would
  reuse unseen.

The calibration forwards are released (without touching any gradient) before the step goes
on. Its footprint is kept small (two tapes and one backward beside what the step holds):
MindSpore's CPU pool keeps what it takes, so a calibration larger than the step would itself be
the measured peak. On a rank with two stages, the second one's calibration can land in pool
memory the first one's freed, which hides part of its growth (``docs/memory.md``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from graph_exec.schedule.memory import ItemSizes, backward_steps, bytes_by_step
from graph_exec.schedule.plan import Plan

#: Taped forwards held per tape measurement: the growth of each after the
#: first is taken (the first compiles and may land in memory the allocator already holds), the
#: median if several. Two keep the calibration's own footprint (two tapes held beside what the
#: step holds) near the step's: the CPU pool keeps what the calibration took, so a larger one
#: would be the measured peak.
FORWARDS = 2
#: Micro-batch keys of the calibration forwards (no real micro-batch is negative).
_KEYS = tuple(-1 - k for k in range(FORWARDS))
#: The key of the backward measured apart from those (the last stage's fused step, a recompute).
_BACKWARD_KEY = -1 - FORWARDS


def _growth(forward: Any) -> tuple[float, list[Any]]:
    """Median growth of memory in use per call of ``forward(k)``, ``k < FORWARDS``, every result
    held, from the second call on; and the results (the caller decides when they go)."""
    from graph_exec.device import memory_in_use, wait_for

    held, seen = [], []
    for k in range(FORWARDS):
        held.append(forward(k))
        wait_for(held[-1])
        seen.append(memory_in_use())
    return float(statistics.median(b - a for a, b in itertools.pairwise(seen))), held


def measure_stage_tape(
    executor: Any, stage: int, inputs: tuple[Any, ...], labels: Any = None, split: bool = False
) -> tuple[int | None, dict[str, int]]:
    """``(tape, transients)`` of ``stage`` on ``inputs``: the bytes one recorded forward keeps
    beyond its inputs and outputs (0 when nothing is recorded: no trained weight and no input
    gradient), and the high-water growth of its backward steps (:func:`backward_transients`),
    run while the measured forwards are still held. ``labels`` (not ``None``) marks the last
    stage; ``split``: the backward is ``I`` then ``W`` (``body="zb"``). The tape is ``None``,
    not measured, where the plan holds none: the last stage (its fused step keeps nothing after
    it) and ``recompute`` (only inputs are kept); there the tape the step builds is in the
    transient."""
    if labels is not None or executor.recompute:
        return None, backward_transients(executor, stage, inputs, labels, split)
    try:
        taped, held = _growth(lambda k: executor.stage_forward(stage, _KEYS[k], inputs))
        transients = backward_transients(executor, stage, inputs, None, split, (_KEYS[0], held[0]))
    finally:
        for key in _KEYS:
            executor.release_forward(stage, key)
    return max(0, round(taped - _new_bytes(held[-1], inputs))), transients


def _new_bytes(outputs: tuple[Any, ...], inputs: tuple[Any, ...]) -> int:
    """Bytes of the outputs a forward made (an input passed through is not new): the library
    counts them itself, so the tape is the growth less them."""
    from graph_exec.runtime.memory_account import tensor_bytes

    return sum(tensor_bytes(t) for t in outputs if not any(t is i for i in inputs))


def backward_transients(
    executor: Any,
    stage: int,
    inputs: tuple[Any, ...],
    labels: Any,
    split: bool,
    kept: tuple[int, tuple[Any, ...]] | None = None,
) -> dict[str, int]:
    """The high-water growth of memory in use, above the level before it, of each step that
    runs a backward of ``stage``, through the executor's own path, by phase
    (:data:`graph_exec.schedule.memory.BACKWARD_PHASES`): the cotangents of its activations and
    its temporaries, which nothing holds between steps. ``kept``: ``(key, outputs)`` of a
    forward of ``stage`` already kept; else one is made here (with ``recompute`` it keeps only
    its inputs and the transient includes the forward the backward rebuilds), and the growth is
    measured from before it: the memory its own temporaries free would otherwise be reused by
    the backward's rebuilt forward and hide that much of it (MindSpore's CPU pool keeps what is
    freed; measured from after the forward, ``recompute``'s transient read 230 MiB where its
    step grew the pool by 338). The last stage (``labels`` not ``None``): ``"fused"``, its
    forward, loss and backward. ``split``: ``"I"`` (or ``"fused"``) less what it holds for
    ``W`` (the library counts that) and ``"W"``. The cotangent is ones of the outputs' shapes
    (floating outputs; the others take none). The gradients it accumulates are then put back as
    they were, exactly."""
    from graph_exec.device import wait_for

    saved = {name: grad.copy() for name, grad in executor.grads().items()}
    wait_for(saved.values())
    key, outputs = kept or (_BACKWARD_KEY, None)
    try:
        if labels is not None:
            phase = "fused"
            growth = _high_water_growth(
                lambda: executor.last_stage_step(stage, key, inputs, labels, hold_weight_grads=split)[1]
            )
        else:
            phase = "I" if split else "B"
            backward = executor.stage_backward_input if split else executor.stage_backward
            if outputs is None:  # measured from before the forward: see the docstring
                growth = _high_water_growth(
                    lambda: backward(stage, key, _ones_like(executor.stage_forward(stage, key, inputs)))
                )
            else:
                cotangents = _ones_like(outputs)
                wait_for(cotangents)
                growth = _high_water_growth(lambda: backward(stage, key, cotangents))
        transients = {phase: growth}
        if split:
            transients[phase] = growth - _held_for_w(executor, stage, key)
            transients["W"] = _weight_backward(executor, stage, key)
    finally:
        executor.release_forward(stage, key)
    _restore(executor, saved)
    return {name: max(0, value) for name, value in transients.items()}


def _held_for_w(executor: Any, stage: int, key: int) -> int:
    """What ``I`` holds for ``W`` under ``(stage, key)``, by the library's own count: the plan's
    prediction counts it already (``held_weight_gradients``), so the transient leaves it out."""
    from graph_exec.runtime.memory_account import held_bytes

    held = executor.held_state().weight_grads.get((stage, key))
    return 0 if held is None else held_bytes(held)


def _weight_backward(executor: Any, stage: int, key: int) -> int:
    """``W`` of ``(stage, key)``: its own high-water growth above the level before it."""

    def weight() -> Any:
        executor.stage_backward_weight(stage, key)
        return executor.grads().values()

    return _high_water_growth(weight)


def _high_water_growth(run: Callable[[], Any]) -> int:
    """How far memory in use rose above its level before ``run()`` while it ran, its results
    (what ``run`` returns, waited for) included."""
    from graph_exec.device import memory_high_water, reset_memory_high_water, wait_for

    level = reset_memory_high_water()
    wait_for(run())
    return memory_high_water() - level


def _ones_like(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A cotangent of ones for each floating output, ``None`` (no gradient) for the others."""
    import mindspore as ms

    from graph_exec.kernels import is_float

    return tuple(ms.ops.ones_like(t) if is_float(t) else None for t in outputs)


def _restore(executor: Any, saved: Mapping[str, Any]) -> None:
    """Every gradient accumulator back to ``saved`` (what calibration added is gone)."""
    from graph_exec.device import assign_in_place, wait_for

    grads = executor.grads()
    for name, value in saved.items():
        assign_in_place(grads[name], value)
    wait_for(grads.values())


class TapeCalibration:
    """The measured tape and backward transients per local stage and the memory in use when the
    first step began (the framework, the parameters, the gradient accumulators and whatever the
    caller made before)."""

    def __init__(self) -> None:
        from graph_exec.device import check_memory_measurable

        check_memory_measurable()  # before the first step, on every rank alike
        self.tapes: dict[int, int] = {}
        self.transients: dict[int, dict[str, int]] = {}
        self.base_in_use: int | None = None
        self.in_use_after: dict[str, int] = {}

    def begin_step(self) -> None:
        """Note the memory in use before the first step."""
        from graph_exec.device import memory_in_use

        if self.base_in_use is None:
            self.base_in_use = memory_in_use()

    def end_step(self) -> None:
        """Note the memory in use after the step, the first and the latest. On CPU, where
        MindSpore's pool keeps what it took, that is the peak so far: the first step's (the
        one the prediction is calibrated on) beside the run's shows what the pool added later
        (freed blocks it could not reuse)."""
        from graph_exec.device import memory_in_use

        now = memory_in_use()
        self.in_use_after.setdefault("first", now)
        self.in_use_after["last"] = now

    def before_forward(
        self, executor: Any, stage: int, inputs: tuple[Any, ...], labels: Any = None, split: bool = False
    ) -> None:
        """Measure ``stage``'s tape and backward transients on its first forward's inputs (once
        per stage; ``labels``: the last stage's, for its loss; ``split``: ``body="zb"``)."""
        if stage not in self.transients:
            tape, self.transients[stage] = measure_stage_tape(executor, stage, inputs, labels, split)
            if tape is not None:
                self.tapes[stage] = tape

    def transient_of(self, step: tuple[str, int] | None) -> int:
        """The measured transient of a step (``(phase, stage)`` from
        :func:`graph_exec.schedule.memory.backward_steps`; ``None``: no backward runs, 0)."""
        if step is None:
            return 0
        phase, stage = step
        return self.transients.get(stage, {}).get(phase, 0)


def tape_timeline(plan: Plan, rank: int, tapes: Mapping[int, int], recompute: bool) -> list[int]:
    """The tape bytes ``rank`` holds during each step of ``plan``: each held forward its
    stage's tape (the plan's memory model says which are held when); with ``recompute`` none is
    held (the one a backward rebuilds is part of that backward's transient)."""
    if recompute:
        return [0] * len(plan.order_codes[rank])
    return bytes_by_step(plan, rank, ItemSizes(activations=dict(tapes), stage_inputs={}))


#: ``stats()["memory"]``'s keys from the calibration, in the order they are reported.
KEYS = (
    "tape_bytes_per_micro",
    "tape_peak",
    "backward_transient_bytes",
    "base_in_use",
    "predicted_parts",
    "predicted_peak",
    "in_use_after_step",
)


def tape_stats(
    calibration: TapeCalibration | None, plan: Plan, rank: int, recompute: bool, held_by_step: list[int]
) -> dict[str, Any]:
    """``stats()["memory"]``'s calibration keys (:data:`KEYS`): ``tape_bytes_per_micro``
    (measured per local stage), ``tape_peak`` (the most held at once, from the plan),
    ``backward_transient_bytes`` (measured per local stage: its largest backward step),
    ``base_in_use`` (memory in use before the first step), ``predicted_peak`` and
    ``predicted_parts``, and ``in_use_after_step`` (memory in use after the first and the latest
    step: :meth:`TapeCalibration.end_step`); all ``None`` without ``measure_tape=True``.

    The prediction is a timeline, not a sum of peaks: per step of the rank's order, the
    library's held bytes at that step (``held_by_step``, its own account of the last step),
    the tapes the plan holds then and the transient of the backward the step runs, if any;
    ``predicted_peak`` is ``base_in_use`` plus the largest such sum, and ``predicted_parts``
    names the parts at that step (they sum to it), so a miss can be traced to a part. Parts
    that peak at different steps (with ``body="zb"``, the tapes while forwards pile up and the
    inputs ``I`` keeps for ``W`` later) are not added as if they peaked together."""
    if calibration is None or calibration.base_in_use is None:
        return dict.fromkeys(KEYS)
    tapes = tape_timeline(plan, rank, calibration.tapes, recompute)
    transients = [calibration.transient_of(step) for step in backward_steps(plan, rank)]
    if len(held_by_step) != len(tapes):
        raise ValueError(f"rank {rank}: {len(held_by_step)} held counts for a plan of {len(tapes)} steps")
    totals = [sum(parts) for parts in zip(held_by_step, tapes, transients, strict=True)]
    at = max(range(len(totals)), key=totals.__getitem__, default=None)
    parts = {
        "base_in_use": calibration.base_in_use,
        "held": 0 if at is None else held_by_step[at],
        "tape": 0 if at is None else tapes[at],
        "backward_transient": 0 if at is None else transients[at],
    }
    return {
        "tape_bytes_per_micro": dict(sorted(calibration.tapes.items())),
        "tape_peak": max(tapes, default=0),
        "backward_transient_bytes": {
            s: max(t.values(), default=0) for s, t in sorted(calibration.transients.items())
        },
        "base_in_use": calibration.base_in_use,
        "predicted_parts": parts,
        "predicted_peak": sum(parts.values()),
        "in_use_after_step": dict(calibration.in_use_after),
    }
