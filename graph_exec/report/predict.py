"""The simulator's prediction of a run's step time from the run's own measured per-op costs.

Costs taken from the measured steps (medians over ranks and steps, seconds):

- ``stage_forward`` / ``stage_backward``: per virtual stage, its median ``F`` / ``B`` plus the
  median of the send that follows it (``Fsend``/``Bsend``): the simulator's sends are free,
  the real ones are not, and they always follow that compute. Per stage, because stages are
  not balanced (stage 0 may hold an embedding or a heavier entry; the last stage's ``F`` is the
  fused forward+loss+backward and its ``B`` only hands the gradient on). ``forward`` /
  ``backward`` report the mean over the non-last stages.
- ``preprocess_forward`` (Pf): median ``TFWD`` plus median ``OUTsend``; ``recompute`` (R):
  median over the ``TBWD`` steps and the compute part of the ``GRADrecv+bwd`` steps (from the
  moment the gradient could have arrived to the end). In a plan without transposition (the
  fair baseline) a ``TBWD`` is the backward from the tape, not a recompute: its median is
  ``preprocess_backward`` and ``recompute`` is 0.
- ``broadcast`` / ``allreduce``: per step, the shortest ``BCAST`` / ``GRADreduce`` over the ranks
  (the last rank to arrive waits least), median over steps.
- ``latency`` / ``bandwidth``: from every send/receive pair, the time from "message sent and
  receiver waiting" to "received" (``recv end − max(send end, recv start)``), fitted as
  ``latency + bytes / bandwidth`` over the activation and preprocess transfer sizes; when the
  sizes are within 2x of each other no bandwidth term can be told apart and the median is
  the latency (bandwidth infinite).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from graph_exec.report.records import Event, RankRecord
from graph_exec.schedule import Plan, Step, StepKind
from graph_exec.schedule.routing import partner
from graph_exec.schedule.steps import SEND_KINDS
from graph_exec.simulate import OpCosts, SimResult, simulate


@dataclass(frozen=True)
class Prediction:
    """The costs fed to the simulator and what it predicted."""

    costs: OpCosts
    result: SimResult

    @property
    def step_time(self) -> float:
        return self.result.step_time

    def error(self, measured: float) -> float:
        """Signed relative error of the predicted step time against ``measured``."""
        return (self.step_time - measured) / measured if measured > 0 else math.nan


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _durations(records: Sequence[RankRecord], warmup: int) -> dict[tuple[StepKind, int | None], list[float]]:
    """Measured durations by (kind, stage), over every rank and measured step."""
    out: dict[tuple[StepKind, int | None], list[float]] = defaultdict(list)
    for record in records:
        for step in record.steps[warmup:]:
            for event in step.events:
                parsed = Step.parse(event.token)
                out[parsed.kind, parsed.stage].append(event.seconds)
    return out


def _per_stage(durations: dict, kind: StepKind, send: StepKind, num_stages: int) -> tuple[float, ...]:
    return tuple(
        _median(durations.get((kind, s), [])) + _median(durations.get((send, s), []))
        for s in range(num_stages)
    )


def _collective(records: Sequence[RankRecord], warmup: int, kind: StepKind) -> float:
    shortest = []
    for index in range(warmup, min(len(r.steps) for r in records)):
        times = [
            e.seconds for r in records for e in r.steps[index].events if Step.parse(e.token).kind is kind
        ]
        if times:
            shortest.append(min(times))
    return _median(shortest)


def _received(plan: Plan, records: Sequence[RankRecord], warmup: int) -> Iterator[tuple[Step, Event, Event]]:
    """Every measured receive with the send it matched: ``(receive step, receive, send)``."""
    for index in range(warmup, min(len(r.steps) for r in records)):
        sends = {
            (rank, step): event
            for rank, record in enumerate(records)
            for event in record.steps[index].events
            if (step := Step.parse(event.token)).kind in SEND_KINDS
        }
        for rank, record in enumerate(records):
            for event in record.steps[index].events:
                step = Step.parse(event.token)
                if step.kind in SEND_KINDS or (sender := plan.peer(rank, step)) is None:
                    continue
                sent = sends.get((sender, partner(step)))
                if sent is not None:
                    yield step, event, sent


def _transfers(plan: Plan, records: Sequence[RankRecord], warmup: int) -> tuple[float, float]:
    """``(latency, bandwidth)`` fitted to every measured transfer (see the module docstring)."""
    sizes = {
        "body": max(r.activation_bytes for r in records),
        "preprocess": max(r.preprocess_bytes for r in records),
    }
    samples = [  # (bytes, seconds); GRADrecv+bwd also computes, so it says nothing about transfers
        (sizes["body" if step.stage is not None else "preprocess"], event.end - max(sent.end, event.start))
        for step, event, sent in _received(plan, records, warmup)
        if step.kind is not StepKind.GRADRECV_BWD
    ]
    if not samples:
        return 0.0, math.inf
    small, large = min(b for b, _ in samples), max(b for b, _ in samples)
    if small <= 0 or large < 2 * small:
        return max(0.0, _median([t for _, t in samples])), math.inf
    mean_b = statistics.fmean(b for b, _ in samples)
    mean_t = statistics.fmean(t for _, t in samples)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in samples) / sum((b - mean_b) ** 2 for b, _ in samples)
    if slope <= 0:
        return max(0.0, mean_t), math.inf
    return max(0.0, mean_t - slope * mean_b), 1.0 / slope


def _recompute(
    plan: Plan, records: Sequence[RankRecord], warmup: int, latency: float, durations: dict
) -> float:
    """Median R over every ``TBWD`` and the compute part of every ``GRADrecv+bwd`` (the time
    after its gradient could have arrived: its wait is the simulator's to work out)."""
    samples = list(durations.get((StepKind.TBWD, None), []))
    samples += [
        event.end - max(event.start, sent.end + latency)
        for step, event, sent in _received(plan, records, warmup)
        if step.kind is StepKind.GRADRECV_BWD
    ]
    return max(0.0, _median(samples))


def measured_costs(plan: Plan, records: Sequence[RankRecord], warmup: int) -> OpCosts:
    """The simulator's cost model filled from a run's measured steps (see module docstring)."""
    durations = _durations(records, warmup)
    transposes = plan.config.transpose
    latency, bandwidth = _transfers(plan, records, warmup)
    forward = _per_stage(durations, StepKind.F, StepKind.FSEND, plan.num_stages)
    backward = _per_stage(durations, StepKind.B, StepKind.BSEND, plan.num_stages)
    body = slice(0, max(1, plan.num_stages - 1))  # the non-last stages (all of them if only one)
    return OpCosts(
        forward=statistics.fmean(forward[body]),
        backward=statistics.fmean(backward[body]),
        stage_forward=forward,
        stage_backward=backward,
        preprocess_forward=_median(durations.get((StepKind.TFWD, None), []))
        + _median(durations.get((StepKind.OUTSEND, None), [])),
        recompute=_recompute(plan, records, warmup, latency, durations) if transposes else 0.0,
        preprocess_backward=0.0 if transposes else _median(durations.get((StepKind.TBWD, None), [])),
        broadcast=_collective(records, warmup, StepKind.BCAST),
        allreduce=_collective(records, warmup, StepKind.GRADREDUCE),
        latency=latency,
        bandwidth=bandwidth,
        activation_bytes=float(max(r.activation_bytes for r in records)),
        preprocess_bytes=float(max(r.preprocess_bytes for r in records)),
    )


def predict(plan: Plan, records: Sequence[RankRecord], warmup: int) -> Prediction:
    """Simulate ``plan`` with the costs measured in ``records``."""
    costs = measured_costs(plan, records, warmup)
    return Prediction(costs, simulate(plan, costs))
