"""What each rank holds while it runs its plan: the schedule's half of the memory model.

A pipeline schedule trades memory for bubbles, and the plan already says, step by step, which
micro-batches each rank holds. This module walks a rank's order and tracks five kinds of held
items, each from the step that makes it to the step after which nothing reads it:

- ``activations`` of stage ``s``, micro ``m``: from ``F s.m`` to ``B s.m`` (what the executor
  keeps for the backward: the tape, or the stage input with ``recompute=True``). The last stage
  fuses forward, loss and backward into ``F``: it holds its micro-batch during that step only.
  With the split backward (``body="zb"``) from ``F s.m`` to ``W s.m``, the last stage included:
  ``W`` forms the weight gradients from the saved layer inputs;
- ``output gradients`` (split backward only): from ``I s.m`` to ``W s.m``, what ``I`` keeps for
  ``W`` — the gradient at the output of each split linear layer (the other half of what its
  weight gradient is made of), and the gradients ``I`` computed for every other parameter
  (layers left whole included); the schedules refuse what would make it a whole copy of the
  chunk's weight gradients per pending ``W`` (``recompute``, dynamic shapes);
- ``receives``: every receive buffer, for the interval :func:`buffer_lifetimes` gives it;
- ``preprocess outputs``: ``TFWD m``'s output, on an owner until ``OUTsend m``, on rank 0 (its
  own or inline micro-batches) until ``F 0.m`` reads it;
- ``preprocess tapes`` (``keep_preprocess_tape``): ``TFWD m``'s tape, until the backward that
  reads it on the same rank (``TBWD m`` or ``GRADrecv+bwd m``).

:func:`held_items` counts them; :func:`peak_bytes` weighs them by sizes and returns the peak
over the step, which is not the sum of the per-kind peaks (they peak at different times);
:func:`bytes_by_step` gives the whole timeline, and :func:`backward_steps` the steps that run a
backward (the runtime adds what a backward needs only while it runs). A
step allocates before it releases: the peak includes what a step reads and what it makes.
Pure Python, like the rest of the schedule layer; sizes come from the caller (calibrated once
per stage by the runtime).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate

from graph_exec.schedule import codes
from graph_exec.schedule.codes import kind_base, stage_of
from graph_exec.schedule.lifetimes import last_reader
from graph_exec.schedule.plan import Plan

#: The kinds of held items, in the order the reports print them.
KINDS = ("activations", "receives", "preprocess outputs", "preprocess tapes", "output gradients")


@dataclass(frozen=True)
class HeldItem:
    """One thing a rank holds from step ``start`` to step ``end`` (indices into its order,
    inclusive), of ``kind``; ``stage`` is the stage whose size it has (-1: the preprocess)."""

    kind: str
    stage: int
    start: int
    end: int


@dataclass(frozen=True)
class ItemSizes:
    """Bytes of one held item of each kind; per stage where stages differ.

    ``activations[s]``: what stage ``s`` keeps per micro-batch for its backward (tape, or the
    input with recompute); ``stage_inputs[s]``: a received input of stage ``s`` (also the size
    of a received gradient of stage ``s - 1``'s output, the same tensor shape); missing stages
    count 0. ``preprocess_output`` and ``preprocess_tape``: per micro-batch.
    ``output_gradients[s]``: what ``I s.m`` keeps for ``W s.m`` with the split backward.
    """

    activations: Mapping[int, int]
    stage_inputs: Mapping[int, int]
    preprocess_output: int = 0
    preprocess_tape: int = 0
    output_gradients: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("activations", "stage_inputs", "output_gradients"):
            for stage, size in getattr(self, name).items():
                if size < 0:
                    raise ValueError(f"ItemSizes.{name}[{stage}] must be >= 0 bytes, got {size}")
        for name in ("preprocess_output", "preprocess_tape"):
            if getattr(self, name) < 0:
                raise ValueError(f"ItemSizes.{name} must be >= 0 bytes, got {getattr(self, name)}")

    def of(self, item: HeldItem) -> int:
        if item.kind == "activations":
            return self.activations.get(item.stage, 0)
        if item.kind == "receives":
            return self.stage_inputs.get(item.stage, 0)
        if item.kind == "output gradients":
            return self.output_gradients.get(item.stage, 0)
        return self.preprocess_output if item.kind == "preprocess outputs" else self.preprocess_tape


def _receive_stage(code: int) -> int:
    """The stage whose input shape a received buffer has (-1: the preprocess's input or output)."""
    kind = kind_base(code)
    if kind == codes.FRECV:
        return stage_of(code)
    if kind == codes.BRECV:
        return stage_of(code) + 1  # the gradient of stage s's output: stage s+1's input shape
    return 0 if kind == codes.OUTRECV else -1


def held_items(plan: Plan, rank: int, keep_preprocess_tape: bool = False) -> list[HeldItem]:
    """Everything ``rank`` holds during ``plan``, with the interval it holds it for."""
    return [HeldItem(*fields) for fields in _intervals(plan, rank, keep_preprocess_tape)]


def peak_counts(plan: Plan, rank: int, keep_preprocess_tape: bool = False) -> dict[str, int]:
    """The most items of each kind ``rank`` holds at once (each kind's own peak)."""
    length = len(plan.order_codes[rank]) + 1
    deltas = {kind: [0] * (length + 1) for kind in KINDS}
    for kind, _, start, end in _intervals(plan, rank, keep_preprocess_tape):
        delta = deltas[kind]
        delta[start] += 1
        delta[end + 1] -= 1
    return {kind: max(0, *accumulate(delta)) for kind, delta in deltas.items()}


def peak_bytes(plan: Plan, rank: int, sizes: ItemSizes, keep_preprocess_tape: bool = False) -> int:
    """The peak over ``rank``'s steps of the bytes it holds, every kind together."""
    return max(0, *bytes_by_step(plan, rank, sizes, keep_preprocess_tape))


def bytes_by_step(plan: Plan, rank: int, sizes: ItemSizes, keep_preprocess_tape: bool = False) -> list[int]:
    """The bytes ``rank`` holds during each of its steps (one entry per step of its order),
    every kind together: the timeline a per-step prediction adds other parts to."""
    items = held_items(plan, rank, keep_preprocess_tape)
    length = len(plan.order_codes[rank])
    return _running(((it.start, it.end, sizes.of(it)) for it in items), length + 1)[:length]


#: What a backward-running step is, for the parts of the memory model that a step needs only
#: while it runs: ``"B"`` (a whole backward), ``"I"`` / ``"W"`` (the split one's halves) and
#: ``"fused"`` (the last stage's forward, loss and backward in one step).
BACKWARD_PHASES = ("B", "I", "W", "fused")


def backward_steps(plan: Plan, rank: int) -> list[tuple[str, int] | None]:
    """Per step of ``rank``'s order, ``(phase, stage)`` if it runs a body backward
    (:data:`BACKWARD_PHASES`), else ``None``. The last stage's backward runs inside its fused
    ``F``: its ``B`` or ``I`` step only routes the input gradients. Forward-only plans run none."""
    if plan.config.forward_only:
        return [None] * len(plan.order_codes[rank])
    phases = {codes.B: "B", codes.I: "I", codes.W: "W"}
    last = plan.last_stage
    out: list[tuple[str, int] | None] = []
    for code in plan.order_codes[rank]:
        kind, stage = kind_base(code), stage_of(code)
        if code < codes.B:
            out.append(("fused", stage) if stage == last else None)
        elif kind in phases and (kind == codes.W or stage != last):
            out.append((phases[kind], stage))
        else:
            out.append(None)
    return out


def _intervals(plan: Plan, rank: int, keep_preprocess_tape: bool) -> list[tuple[str, int, int, int]]:
    """``(kind, stage, start, end)`` of every held item, as plain tuples over the step codes:
    the JSON export computes every rank's peaks, and for a plan of 1.6 million steps objects per
    step or per item (``buffer_lifetimes``) took several times longer."""
    row = plan.order_codes[rank]
    index = {code: i for i, code in enumerate(row)}
    out: list[tuple[str, int, int, int]] = []
    training = not plan.config.forward_only
    last, forward_only, split = plan.last_stage, plan.config.forward_only, plan.config.split_backward
    shift, mask, limit, tfwd = codes.KIND_SHIFT, codes.FIELD_MASK, codes.B, codes.TFWD
    f_to_w, i_to_w = codes.W - codes.F, codes.W - codes.I
    receives = set(codes.SEND_OF_RECV) - {codes.GRADRECV_BWD}  # that one is read by its own step
    for i, code in enumerate(row):
        kind = code >> shift << shift
        if code < limit:  # F s.m
            if training:
                stage = code >> codes.STAGE_SHIFT & mask
                if split:
                    end = index[code + f_to_w]
                else:
                    end = i if stage == last else index[code - codes.F + codes.B]
                out.append(("activations", stage, i, end))
        elif kind == codes.I:
            out.append(("output gradients", code >> codes.STAGE_SHIFT & mask, i, index[code + i_to_w]))
        elif kind in receives:
            end = index[last_reader(code, last, forward_only, split)]  # as buffer_lifetimes says
            out.append(("receives", _receive_stage(code), i, end))
        elif kind == tfwd:
            micro = code & mask
            ship = index.get(codes.OUTSEND | micro)
            end = ship if ship is not None else index[codes.F | micro]  # rank 0: F 0.m reads it
            out.append(("preprocess outputs", -1, i, end))
            if keep_preprocess_tape and training:
                reader = index.get(codes.TBWD | micro, index.get(codes.GRADRECV_BWD | micro))
                if reader is not None:
                    out.append(("preprocess tapes", -1, i, reader))
    return out


def _running(intervals: Iterable[tuple[int, int, int]], length: int) -> list[int]:
    """The running sum of ``(start, end, size)`` per step: each counts from step ``start``
    through step ``end``."""
    delta = [0] * (length + 1)
    for start, end, size in intervals:
        delta[start] += size
        delta[end + 1] -= size
    return list(accumulate(delta))
