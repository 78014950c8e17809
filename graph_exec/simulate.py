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

from dataclasses import dataclass
from functools import cached_property

from graph_exec.schedule import Plan, PlanConfig, ScheduleError, build_plan, check_plan_size, codes, placement
from graph_exec.schedule.codes import BODY_LIMIT, kind_base
from graph_exec.schedule.costs import OpCosts, step_cost
from graph_exec.schedule.size import SIMULATE_BYTES_PER_STEP
from graph_exec.schedule.walk import walk

__all__ = [
    "OpCosts",
    "SimResult",
    "TimelineEntry",
    "fair_baseline",
    "placed_weights",
    "simulate",
    "to_chrome_trace",
]


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
    over ``forward``, and this model's backward (a split one's ``I`` and ``W`` each by its own
    cost) and transfers; per-stage overrides aside, as the runtime knows none.
    """
    if tower_order not in placement.TOWER_ORDERS:
        raise ValueError(f"tower_order must be one of {placement.TOWER_ORDERS}, got {tower_order!r}")
    weights = costs.tower_weights(config.micro)
    if tower_order == "arrival" or not config.mpipe:
        return tuple(range(config.micro)), weights
    if costs.forward == 0:  # nothing to measure the towers against: balance them as they are
        unit = 1.0
        step_costs = placement.StepCosts(
            backward=0.0, fused_last_stage=costs.fused_last_stage, input_backward=0.0, weight_backward=0.0
        )
    else:
        unit = costs.preprocess_forward / costs.forward
        step_costs = placement.StepCosts(
            backward=costs.backward / costs.forward,
            fused_last_stage=costs.fused_last_stage,
            transfer=costs.transfer_time(codes.FSEND) / costs.forward,
            tower_transfer=costs.transfer_time(codes.OUTSEND) / costs.forward,
            input_backward=None if costs.input_backward is None else costs.input_backward / costs.forward,
            weight_backward=None if costs.weight_backward is None else costs.weight_backward / costs.forward,
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


def _simulate(plan: Plan, costs: OpCosts, tower_order: str = "arrival") -> SimResult:
    rows = plan.order_codes
    order, weights = placed_weights(plan.config, costs, tower_order)
    replay = walk(rows, step_cost(costs, plan.config, weights), record=True)
    if not replay.complete(rows):
        stuck = [r for r, (p, row) in enumerate(zip(replay.pos, rows, strict=True)) if p < len(row)]
        raise ScheduleError(f"simulation cannot finish: ranks {stuck} wait forever (validate the plan)")
    step_time = max((row[-1][2] for row in replay.steps if row), default=0.0)
    return SimResult(step_time, tuple(replay.busy), tuple(map(tuple, replay.steps)), order=order)


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
