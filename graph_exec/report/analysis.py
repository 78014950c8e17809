"""What one run's per-rank records say: step time, bubble, runtime overhead, counters.

Definitions (all per measured step, then the median over the measured steps):

- **step time**: from the first rank entering ``run()`` to the last rank leaving it. Every
  step starts after a barrier, so this is the time the pipeline needs for one step.
- **compute**: time in the steps that run kernels: ``F``, ``B``, ``TFWD``, ``TBWD``,
  ``GRADrecv+bwd``.
- **bubble fraction**: ``1 - sum(compute over ranks) / (ranks * step time)``: the share of the
  ranks' time not spent computing (waiting for peers, transfers, collectives, overhead).
- **runtime overhead** of a rank: the time it spends in ``run()`` that is neither inside a
  kernel nor receiving from or waiting for a peer, i.e. the runtime's own work:
  (``run()`` wall time − the summed durations of its plan steps: the driver walking the plan,
  splitting the batch, releasing buffers) + (the summed durations of its send steps: the
  transport posting messages, which never waits for the peer) + (its compute-hook calls ×
  the executor's measured per-call dispatch cost: signature, cache lookup, parameter-storage
  check, bookkeeping around the kernel). Reported as a share of the step time for the rank
  where it is largest. Receives and collectives are not counted: their time is mostly
  waiting for a peer, which a faster runtime could not remove.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from graph_exec.report.records import RankRecord, StepRecord
from graph_exec.schedule import Step, StepKind
from graph_exec.schedule.steps import SEND_KINDS

COMPUTE_KINDS = frozenset(
    {StepKind.F, StepKind.B, StepKind.I, StepKind.W, StepKind.TFWD, StepKind.TBWD, StepKind.GRADRECV_BWD}
)


def kind_of(token: str) -> StepKind:
    return Step.parse(token).kind


def calls_hook(token: str, last_stage: int) -> bool:
    """Whether the step calls an executor hook (the last stage's ``B``, or ``I`` with the split
    backward, only forwards the gradient its fused ``F`` computed)."""
    step = Step.parse(token)
    gradient_only = step.kind in (StepKind.B, StepKind.I) and step.stage == last_stage
    return step.kind in COMPUTE_KINDS and not gradient_only


@dataclass(frozen=True)
class StepView:
    """One measured step seen across all ranks."""

    step: int
    seconds: float  #: step time (see module docstring)
    compute: tuple[float, ...]  #: per rank
    overhead: tuple[float, ...]  #: per rank, runtime overhead in seconds

    @property
    def bubble(self) -> float:
        if self.seconds <= 0:
            return 0.0
        return 1.0 - sum(self.compute) / (len(self.compute) * self.seconds)

    @property
    def overhead_share(self) -> float:
        return max(self.overhead) / self.seconds if self.seconds > 0 else 0.0


def median_seconds(records: Sequence[RankRecord], warmup: int, kind: StepKind) -> float | None:
    """Median duration of the measured steps of ``kind`` over all ranks (``None`` if none ran)."""
    values = [
        e.seconds for r in records for s in r.steps[warmup:] for e in s.events if kind_of(e.token) is kind
    ]
    return statistics.median(values) if values else None


def rank_overhead(step: StepRecord, dispatch_seconds: float, last_stage: int) -> float:
    """The runtime overhead of one rank in one step (see module docstring)."""
    outside = (step.end - step.start) - sum(e.seconds for e in step.events)
    sends = sum(e.seconds for e in step.events if kind_of(e.token) in SEND_KINDS)
    hooks = sum(calls_hook(e.token, last_stage) for e in step.events)
    return max(0.0, outside) + sends + hooks * dispatch_seconds


def dispatch_estimate(records: Sequence[RankRecord]) -> float:
    """The median of the ranks' calibrated dispatch costs (0 where none was measured)."""
    values = [r.dispatch_seconds for r in records if r.dispatch_seconds is not None]
    return statistics.median(values) if values else 0.0


def step_views(records: Sequence[RankRecord], warmup: int, last_stage: int) -> list[StepView]:
    """The measured steps (those after ``warmup``), merged across ranks."""
    dispatch = dispatch_estimate(records)
    views = []
    for index in range(warmup, min(len(r.steps) for r in records)):
        steps = [r.steps[index] for r in records]
        views.append(
            StepView(
                step=steps[0].step,
                seconds=max(s.end for s in steps) - min(s.start for s in steps),
                compute=tuple(
                    sum(e.seconds for e in s.events if kind_of(e.token) in COMPUTE_KINDS) for s in steps
                ),
                overhead=tuple(rank_overhead(s, dispatch, last_stage) for s in steps),
            )
        )
    return views


@dataclass(frozen=True)
class RunSummary:
    """The numbers a run reports (times in seconds)."""

    step_time: float  #: median step time
    step_times: tuple[float, ...]
    bubble: float  #: median bubble fraction
    overhead: float  #: median runtime-overhead share of the step time
    dispatch_seconds: float  #: per hook call, as calibrated (0 if not)
    compilations: int  #: summed over ranks, whole run
    compile_seconds: float  #: summed over ranks, whole run
    allocations_after_warmup: int  #: receive-buffer allocations after warm-up, summed over ranks
    losses: tuple[float, ...]  #: mean loss of every step, warm-up included


def summarize(records: Sequence[RankRecord], warmup: int, last_stage: int) -> RunSummary:
    """Merge the ranks' records of one run (``warmup`` leading steps are not measured)."""
    views = step_views(records, warmup, last_stage)
    if not views:
        raise ValueError(f"no measured steps: every rank recorded at most {warmup} warm-up steps")
    finals = [r.steps[-1] for r in records]
    warmed = [r.steps[warmup - 1].allocations if warmup else 0 for r in records]
    loss_rank = next((r for r in records if r.steps[0].loss is not None), None)
    return RunSummary(
        step_time=statistics.median(v.seconds for v in views),
        step_times=tuple(v.seconds for v in views),
        bubble=statistics.median(v.bubble for v in views),
        overhead=statistics.median(v.overhead_share for v in views),
        dispatch_seconds=dispatch_estimate(records),
        compilations=sum(s.compilations for s in finals),
        compile_seconds=sum(s.compile_seconds for s in finals),
        allocations_after_warmup=sum(s.allocations for s in finals) - sum(warmed),
        losses=() if loss_rank is None else tuple(s.loss for s in loss_rank.steps),
    )
