"""The one cost type of the plan replays, and the one rule that prices a step by it.

Simulation (:mod:`graph_exec.simulate`) and tower placement (:mod:`.placement`) replay a plan
through :func:`graph_exec.schedule.walk.walk`; both price its steps with :func:`step_cost`, so
a step costs the same wherever it is replayed. The conventions (per chunk, the fused last
stage, the split backward's ``I`` and ``W``, towers, transfers) are the simulator's module
docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from graph_exec.schedule import codes
from graph_exec.schedule.codes import BODY_LIMIT, FIELD_MASK, PAIR_DELTA, STAGE_SHIFT, kind_base
from graph_exec.schedule.config import PlanConfig

#: ``cost(code)``: a compute step's duration, a send's travel time (its message is at the
#: receiver that long after the send), a receive's work once its message is there, a
#: collective's duration.
Cost = Callable[[int], float]


@dataclass(frozen=True)
class OpCosts:
    """Per-step costs of the model (``graph_exec.simulate``'s docstring has the conventions)."""

    forward: float = 1.0  #: one ``F`` step: one chunk, one micro-batch
    backward: float = 2.0  #: one ``B`` step
    #: One ``I`` step (input gradient of a split backward); ``None``: half of the stage's ``backward``.
    input_backward: float | None = None
    #: One ``W`` step (weight gradients of a split backward); ``None``: half of the stage's ``backward``.
    weight_backward: float | None = None
    preprocess_forward: float = 0.0  #: Pf: one ``TFWD``
    recompute: float = 0.0  #: R: one ``TBWD`` that recomputes, or the compute of one ``GRADrecv+bwd``
    #: One ``TBWD`` of a plan without transposition: the preprocess backward from the tape.
    preprocess_backward: float = 0.0
    broadcast: float = 0.0  #: one ``BCAST``
    allreduce: float = 0.0  #: one ``GRADreduce``
    latency: float = 0.0  #: per transfer
    bandwidth: float = math.inf  #: bytes per time unit
    activation_bytes: float = 0.0  #: per body transfer (``Fsend`` / ``Bsend``)
    preprocess_bytes: float = 0.0  #: per ``OUT`` / ``IN`` / ``GRAD`` transfer
    fused_last_stage: bool = False  #: the last stage runs forward+loss+backward at ``F``
    #: Per-stage overrides of ``forward`` / ``backward`` (index = virtual stage; empty = none),
    #: for models whose stages are not balanced, e.g. a baseline stage 0 holding the preprocess.
    stage_forward: tuple[float, ...] = ()
    stage_backward: tuple[float, ...] = ()
    #: Per user micro-batch: the weight of its tower (multiplies Pf, R and
    #: ``preprocess_backward``); empty = every micro-batch weighs 1.
    tower_costs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "fused_last_stage" or (
                field.name in ("input_backward", "weight_backward") and value is None
            ):
                continue
            if field.name in ("stage_forward", "stage_backward", "tower_costs"):
                if any(
                    isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf
                    for v in value
                ):
                    raise ValueError(f"{field.name} must hold finite numbers >= 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise ValueError(f"{field.name} must be a number, got {value!r}")
            if field.name == "bandwidth":
                if value <= 0:
                    raise ValueError(f"bandwidth must be > 0 (inf for free transfers), got {value!r}")
            elif value < 0 or math.isinf(value):
                raise ValueError(f"{field.name} must be a finite number >= 0, got {value!r}")

    def forward_at(self, stage: int) -> float:
        """One ``F`` step of ``stage``."""
        return self.stage_forward[stage] if stage < len(self.stage_forward) else self.forward

    def backward_at(self, stage: int) -> float:
        """One ``B`` step of ``stage``."""
        return self.stage_backward[stage] if stage < len(self.stage_backward) else self.backward

    def input_backward_at(self, stage: int) -> float:
        """One ``I`` step of ``stage``: ``input_backward``, or half of the stage's ``B``."""
        return self.backward_at(stage) / 2 if self.input_backward is None else self.input_backward

    def weight_backward_at(self, stage: int) -> float:
        """One ``W`` step of ``stage``: ``weight_backward``, or half of the stage's ``B``."""
        return self.backward_at(stage) / 2 if self.weight_backward is None else self.weight_backward

    def transfer_time(self, code: int) -> float:
        """How long the message of the send ``code`` travels: latency plus its bytes over bandwidth."""
        size = self.activation_bytes if code < BODY_LIMIT else self.preprocess_bytes
        return self.latency + size / self.bandwidth

    def tower_weights(self, micro: int) -> tuple[float, ...]:
        """Every user micro-batch's tower weight (1 each without ``tower_costs``)."""
        if not self.tower_costs:
            return (1.0,) * micro
        if len(self.tower_costs) != micro:
            raise ValueError(
                f"tower_costs has {len(self.tower_costs)} values but the plan has {micro} micro-batches"
            )
        return self.tower_costs


def step_cost(costs: OpCosts, config: PlanConfig, weights: Sequence[float]) -> Cost:
    """The cost rule: what each step of ``config``'s plan costs under ``costs``.

    ``weights[m]`` is plan micro ``m``'s tower weight (it multiplies ``TFWD``, ``TBWD`` and
    ``GRADrecv+bwd``). The last stage fused (``fused_last_stage``) runs its loss and backward
    (or, split, its input gradient) at ``F``: its ``B`` and ``I`` then cost nothing, its ``W``
    still costs ``weight_backward``.
    """
    last_stage = config.last_stage
    fused, split = costs.fused_last_stage, config.split_backward
    tbwd = costs.recompute if config.transpose else costs.preprocess_backward
    tower = {
        codes.TFWD: costs.preprocess_forward,
        codes.TBWD: tbwd,
        codes.GRADRECV_BWD: costs.recompute,
    }
    collective = {codes.BCAST: costs.broadcast, codes.GRADREDUCE: costs.allreduce}

    def compute(code: int) -> float:
        stage = code >> STAGE_SHIFT & FIELD_MASK
        fused_here = fused and stage == last_stage
        if code < codes.B:
            if not fused_here:
                return costs.forward_at(stage)
            return costs.forward_at(stage) + (
                costs.input_backward_at(stage) if split else costs.backward_at(stage)
            )
        if code < codes.I:
            return 0.0 if fused_here else costs.backward_at(stage)
        if code < codes.W:
            return 0.0 if fused_here else costs.input_backward_at(stage)
        return costs.weight_backward_at(stage)

    def cost(code: int) -> float:
        if code < codes.FSEND:
            return compute(code)
        kind = kind_base(code)
        if kind in PAIR_DELTA:
            return costs.transfer_time(code)
        if kind in tower:
            return tower[kind] * weights[code & FIELD_MASK]
        return collective.get(kind, 0.0)

    return cost
