"""Cost-model timeline of a plan: step time, busy/idle per rank, bubble, MPipe saving, trace.

List scheduling: every rank runs its order sequentially, each step as soon as the previous
one is done and its input is there.

- Compute steps take their cost: ``F`` = ``forward``, ``B`` = ``backward`` (per chunk, i.e.
  per step), the split backward's ``I`` = ``input_backward`` and ``W`` = ``weight_backward``
  (each half of ``backward`` unless given), ``TFWD`` = ``preprocess_forward`` (Pf), ``TBWD`` =
  ``recompute`` (R), ``GRADrecv+bwd`` = R once its gradient has arrived.
- Towers of different cost: ``tower_costs`` gives each user micro-batch a weight (its image
  patches, say) that multiplies its Pf, R and ``preprocess_backward``; ``tower_order`` says
  which user micro-batch runs as which plan micro (:mod:`graph_exec.schedule.placement`).
- Sends are non-blocking (the transport buffers them) and take no time on the sender; the
  message is at the receiver ``latency + bytes / bandwidth`` after the send. A receive
  ends when its message is there (its wait is idle time).
- ``BCAST`` and ``GRADreduce`` are synchronisation points: they start when the last rank
  reaches them and take ``broadcast`` / ``allreduce`` on every rank.

Conventions. ``forward`` and ``backward`` are per *chunk*: a rank's whole slice of the model
costs ``F = V * forward`` and ``B = V * backward`` per micro-batch. With those, free
communication and balanced stages the simulator reproduces the closed forms exactly:
``(M + P - 1) * (F + B)`` for plain 1F1B and GPipe (``V = 1``), and
``M * (F + B) + (P - 1) * (F + B) / V`` for interleaved 1F1B when ``M`` is a multiple of ``P``
(also for looped GPipe with ``M >= P``). By default the last stage's ``F`` and ``B`` cost
``forward`` and ``backward`` like any stage (the textbook model); ``fused_last_stage=True``
models the runtime's fused forward+loss+backward instead: ``F`` of the last stage costs
``forward + backward`` and its ``B`` (which only ships the gradient) costs nothing; with the split
backward, the fused ``F`` costs ``forward + input_backward``, its ``I`` nothing, and its ``W``
``weight_backward`` (the weight gradients still wait for their step).

MPipe saving: for a plan that transposes, the *fair baseline* — the same configuration
without transposition (``transpose=False``: rank 0 runs ``TFWD m`` right before ``F 0.m`` and,
trainable, ``TBWD m`` right after ``B 0.m``) — is simulated under the same costs, and
:attr:`SimResult.saving` is the difference. In the fair baseline a ``TBWD`` is the preprocess
backward from the tape, nothing recomputed: it costs ``preprocess_backward``; an MPipe ``TBWD``
or ``GRADrecv+bwd`` recomputes the forward and costs ``recompute``. In the textbook convention
the preprocess backward is counted in stage 0's ``backward``, ``preprocess_backward`` is 0 and
``recompute`` is what rank 0 pays extra, e.g. ``R ~ Pf`` for a trainable tower, ``R ~ 0`` for an
embedding; measured costs (:mod:`graph_exec.report.predict`) fill both with real step times.

Costs are in any time unit; the chrome trace takes it to be milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property

from graph_exec.schedule import Plan, PlanConfig, ScheduleError, build_plan, check_plan_size, codes, placement
from graph_exec.schedule.codes import BODY_LIMIT, FIELD_MASK, PAIR_DELTA, SEND_OF_RECV, STAGE_SHIFT, kind_base
from graph_exec.schedule.size import SIMULATE_BYTES_PER_STEP


@dataclass(frozen=True)
class OpCosts:
    """Per-step costs of the model (see the module docstring for the conventions)."""

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

    def tower_weights(self, micro: int) -> tuple[float, ...]:
        """Every user micro-batch's tower weight (1 each without ``tower_costs``)."""
        if not self.tower_costs:
            return (1.0,) * micro
        if len(self.tower_costs) != micro:
            raise ValueError(
                f"tower_costs has {len(self.tower_costs)} values but the plan has {micro} micro-batches"
            )
        return self.tower_costs


@dataclass(frozen=True)
class TimelineEntry:
    """One step as the simulator placed it."""

    rank: int
    token: str
    start: float
    end: float


@dataclass(frozen=True, eq=False)
class SimResult:
    """What :func:`simulate` found. ``baseline`` is the fair baseline: the same plan without
    transposition, under the same costs (plans that transpose only)."""

    step_time: float
    busy: tuple[float, ...]  # per rank: time spent computing or in a collective
    steps: tuple[tuple[tuple[int, float, float], ...], ...]  # per rank: (code, start, end)
    baseline: SimResult | None = None
    #: ``order[m]``: the user micro-batch that ran as plan micro ``m``.
    order: tuple[int, ...] = ()

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: the step time not spent busy (waiting for data, warm-up, drain)."""
        return tuple(self.step_time - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``sum(idle) / (P * step_time)``."""
        if self.step_time == 0:
            return 0.0
        return sum(self.idle) / (len(self.busy) * self.step_time)

    @property
    def saving(self) -> float | None:
        """How much shorter the step is than the fair baseline's (``None`` when nothing is transposed)."""
        return None if self.baseline is None else self.baseline.step_time - self.step_time

    @cached_property
    def timeline(self) -> tuple[TimelineEntry, ...]:
        """Every step as (rank, token, start, end), rank by rank in execution order."""
        return tuple(
            TimelineEntry(rank, codes.token(code), start, end)
            for rank, row in enumerate(self.steps)
            for code, start, end in row
        )


def simulate(plan: Plan, costs: OpCosts, tower_order: str = "arrival") -> SimResult:
    """Simulate ``plan`` under ``costs``; plans that transpose also get the fair baseline.

    ``tower_order`` (``"arrival"`` or ``"balanced"``) places the user micro-batches' towers as
    the schedules' option of that name does, the fair baseline's by its own plan. Refuses
    (:class:`~graph_exec.schedule.PlanTooLargeError`, before simulating) a plan whose
    simulation would take more than the memory :mod:`graph_exec.schedule.size` allows.
    """
    check_plan_size(plan.config, SIMULATE_BYTES_PER_STEP, "simulating the plan")
    baseline = None
    if plan.config.mpipe and plan.config.transpose:
        baseline = _simulate(fair_baseline(plan), costs, tower_order)
    result = _simulate(plan, costs, tower_order)
    return SimResult(result.step_time, result.busy, result.steps, baseline, result.order)


def placed_weights(
    config: PlanConfig, costs: OpCosts, tower_order: str
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The decision for ``config`` and each plan micro's tower weight under it.

    The decision takes its costs in units of one chunk forward: the towers' weights times Pf
    over ``forward``, and this model's backward and transfers (per-stage overrides aside).
    """
    if tower_order not in placement.TOWER_ORDERS:
        raise ValueError(f"tower_order must be one of {placement.TOWER_ORDERS}, got {tower_order!r}")
    weights = costs.tower_weights(config.micro)
    if tower_order == "arrival" or not config.mpipe:
        return tuple(range(config.micro)), weights
    if costs.forward == 0:  # nothing to measure the towers against: balance them as they are
        unit, step_costs = 1.0, placement.StepCosts(backward=0.0, fused_last_stage=costs.fused_last_stage)
    else:
        unit = costs.preprocess_forward / costs.forward
        step_costs = placement.StepCosts(
            backward=costs.backward / costs.forward,
            fused_last_stage=costs.fused_last_stage,
            transfer=(costs.latency + costs.activation_bytes / costs.bandwidth) / costs.forward,
            tower_transfer=(costs.latency + costs.preprocess_bytes / costs.bandwidth) / costs.forward,
        )
    positions = placement.tower_positions(config, step_costs)
    order = placement.tower_order(positions, [w * unit for w in weights], tower_order)
    return order, tuple(weights[u] for u in order)


def fair_baseline(plan: Plan) -> Plan:
    """The plan MPipe is measured against: the same body and preprocess, nothing transposed.

    Dataload only (``preprocess="none"``) has nothing to run on rank 0, so that is the body.
    """
    cfg = plan.config
    return build_plan(
        PlanConfig(
            pp=cfg.pp,
            vpp=cfg.vpp,
            micro=cfg.micro,
            preprocess=cfg.preprocess,
            num_preprocess_layers=cfg.num_preprocess_layers,
            body=cfg.body,
            transpose=False,
        )
    )


class _State:
    """Messages and collectives shared by the ranks of one simulation."""

    def __init__(self, pp: int) -> None:
        self.arrival: dict[int, float] = {}  # message (send code) -> time it is at the receiver
        self.waiter: dict[int, int] = {}  # message -> rank blocked on it
        self.arrived: dict[int, list[float]] = {}  # collective -> clocks of the ranks there
        self.waiting: dict[int, list[int]] = {}  # collective -> ranks blocked on it
        self.finished: dict[int, float] = {}  # collective -> its end time
        self.work = list(range(pp))


def _simulate(plan: Plan, costs: OpCosts, tower_order: str = "arrival") -> SimResult:
    pp = plan.config.pp
    rows = plan.order_codes
    state = _State(pp)
    busy = [0.0] * pp
    steps: list[list[tuple[int, float, float]]] = [[] for _ in range(pp)]
    order, weights = placed_weights(plan.config, costs, tower_order)
    ranks = [_rank(plan, rows[r], r, costs, weights, state, busy, steps[r]) for r in range(pp)]
    while state.work:
        next(ranks[state.work.pop()], None)
    stuck = [r for r in range(pp) if len(steps[r]) < len(rows[r])]
    if stuck:
        raise ScheduleError(f"simulation cannot finish: ranks {stuck} wait forever (validate the plan)")
    step_time = max((row[-1][2] for row in steps if row), default=0.0)
    return SimResult(step_time, tuple(busy), tuple(map(tuple, steps)), order=order)


def _rank(
    plan: Plan,
    row: Sequence[int],
    rank: int,
    costs: OpCosts,
    weights: Sequence[float],
    state: _State,
    busy: list[float],
    out: list[tuple[int, float, float]],
) -> Iterator[None]:
    """One rank's list scheduling; yields while it waits for a message or a collective."""
    last_stage = plan.last_stage
    fused = costs.fused_last_stage
    split = plan.config.split_backward
    tbwd = costs.recompute if plan.config.transpose else costs.preprocess_backward
    clock = 0.0
    for code in row:
        kind = kind_base(code)
        start = clock
        if code < codes.FSEND:  # F, B, I or W
            stage = code >> STAGE_SHIFT & FIELD_MASK
            fused_here = fused and stage == last_stage
            if kind == codes.F:
                cost = costs.forward_at(stage) + (
                    (costs.input_backward_at(stage) if split else costs.backward_at(stage))
                    if fused_here
                    else 0.0
                )
            elif kind == codes.B:
                cost = 0.0 if fused_here else costs.backward_at(stage)
            elif kind == codes.I:
                cost = 0.0 if fused_here else costs.input_backward_at(stage)
            else:
                cost = costs.weight_backward_at(stage)
            clock += cost
            busy[rank] += cost
        elif kind in (codes.TFWD, codes.TBWD):
            cost = (costs.preprocess_forward if kind == codes.TFWD else tbwd) * weights[code & FIELD_MASK]
            clock += cost
            busy[rank] += cost
        elif kind in PAIR_DELTA:  # send: buffered, the message travels on its own
            size = costs.activation_bytes if code < BODY_LIMIT else costs.preprocess_bytes
            state.arrival[code] = clock + costs.latency + size / costs.bandwidth
            if code in state.waiter:
                state.work.append(state.waiter.pop(code))
        elif kind in SEND_OF_RECV:
            message = code - PAIR_DELTA[SEND_OF_RECV[kind]]
            while message not in state.arrival:
                state.waiter[message] = rank
                yield
            clock = max(clock, state.arrival.pop(message))
            if kind == codes.GRADRECV_BWD:
                cost = costs.recompute * weights[code & FIELD_MASK]
                clock += cost
                busy[rank] += cost
        else:  # BCAST or GRADreduce: everybody's, starts when the last rank is there
            cost = costs.broadcast if kind == codes.BCAST else costs.allreduce
            clocks = state.arrived.setdefault(code, [])
            clocks.append(clock)
            if len(clocks) == plan.config.pp:
                state.finished[code] = max(clocks) + cost
                state.work.extend(state.waiting.pop(code, []))
            while code not in state.finished:
                state.waiting.setdefault(code, []).append(rank)
                yield
            clock = state.finished[code]
            busy[rank] += cost
        out.append((code, start, clock))


def to_chrome_trace(result: SimResult) -> dict:
    """The timeline as a chrome://tracing / Perfetto document: one track (thread) per rank.

    Times are written in microseconds, taking one cost unit to be a millisecond. Each event's
    category (compute, p2p, collective, mpipe) lets a viewer colour or filter them.
    """
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "graph-exec simulation"}}
    ]
    for rank, row in enumerate(result.steps):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        )
        for code, start, end in row:
            events.append(
                {
                    "name": codes.token(code),
                    "cat": _category(code),
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * 1000.0,
                    "dur": (end - start) * 1000.0,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _category(code: int) -> str:
    kind = kind_base(code)
    if code < codes.FSEND:
        return "compute"
    if code < BODY_LIMIT:
        return "p2p"
    if kind in (codes.BCAST, codes.GRADREDUCE):
        return "collective"
    return "mpipe"
