"""Choose a plan: search the schedule's options with the simulator and the memory model.

A pipeline's options trade memory for bubbles — interleaving holds more micro-batches on the
first ranks, MPipe's ``full`` run-ahead keeps the owners' tower outputs, ``recompute`` trades
compute for activations, the rebalanced split moves layers (and their parameters and optimizer
state) off rank 0 — so the fastest plan is often not one that fits. :func:`tune` predicts, for
every candidate, the step time (:func:`graph_exec.simulate.simulate`) and every rank's peak
memory (:mod:`graph_exec.schedule.memory` plus parameters, gradients and optimizer state), and
returns the candidates that fit a budget, fastest first.

The costs come from :class:`ModelCosts`: per decoder layer and per preprocess, measured once on
one micro-batch of ``micro_batch_size`` rows. A candidate with ``M`` micro-batches of a global
batch of ``B`` rows runs micro-batches of ``B / M`` rows; compute, transfer sizes and
activations are taken to scale linearly with the rows (the model's cost per row is constant),
which holds while a micro-batch is large enough to keep the device busy — below that, measure
at the micro-batch size you will run.

Pure Python, no MindSpore: a cost file (JSON of :class:`ModelCosts`'s fields) is enough, so a
plan for a 64-device job can be chosen on a laptop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from graph_exec.balance import even_layers, rebalanced_layers
from graph_exec.cost_file import CostFileError, ModelCosts
from graph_exec.schedule import Plan, PlanConfig, build_plan
from graph_exec.schedule.memory import KINDS, ItemSizes, held_items
from graph_exec.simulate import OpCosts, simulate

__all__ = [  # ModelCosts and CostFileError live in graph_exec.cost_file; users import them from here too
    "PARTS",
    "SPLITTABLE",
    "Candidate",
    "CostFileError",
    "ModelCosts",
    "NoPlanFitsError",
    "Predicted",
    "candidates",
    "compute_scale",
    "predict",
    "table",
    "tune",
]


#: Where a rank's peak goes: its state, then what the schedule holds at the peak step.
#: ``recomputed tape``: with ``recompute``, the one tape a backward rebuilds and reads at once.
PARTS = ("parameters", "gradients", "optimizer", *KINDS, "recomputed tape")


class NoPlanFitsError(ValueError):
    """No candidate fits the memory budget; names the smallest predicted peak and its plan."""


@dataclass(frozen=True)
class Candidate:
    """One plan: the schedule, the split and the schedule's options."""

    schedule: str  #: ``"mpipe"`` (ScheduleMPipeTranspose) or ``"baseline"`` (ScheduleInterleaved1F1B)
    split: str  #: ``"even"`` or ``"rebalanced"`` (fewer layers where the preprocess runs)
    vpp: int
    micro: int
    run_ahead: str = "full"  #: MPipe's ``run_ahead``: ``"full"`` or ``"min"``
    backward: str = "central"  #: MPipe, trainable preprocess: ``"central"`` or ``"owner"``
    recompute: bool = False

    def describe(self) -> str:
        parts = [self.schedule, f"split={self.split}", f"V={self.vpp}", f"M={self.micro}"]
        if self.schedule == "mpipe":
            parts.append(f"run_ahead={self.run_ahead}")
            if self.backward != "central":
                parts.append(f"backward={self.backward}")
        return " ".join([*parts, f"recompute={'on' if self.recompute else 'off'}"])


@dataclass(frozen=True)
class Predicted:
    """A candidate's predicted step time and per-rank peak bytes."""

    candidate: Candidate
    step_time: float
    peak_bytes: tuple[int, ...]  #: per pipeline rank: parameters, gradients, optimizer, held items
    layers: tuple[int, ...]  #: decoder layers per stage
    #: The per-step costs simulated (each compute step with the runtime's ``op_overhead``).
    op_costs: OpCosts | None = None
    op_overhead: float = 0.0
    #: Per pipeline rank, where its peak goes (:data:`PARTS`: bytes of each at the peak step).
    parts: tuple[dict[str, int], ...] = ()

    def compute_time(self, costs: OpCosts | None = None, overhead: float | None = None) -> float:
        """One micro-batch's compute of the stages before the last, and the preprocess forward,
        without the per-step overhead: of this prediction, or of ``costs`` measured for the same
        plan (the last stage is left out: its fused step is counted differently in the two)."""
        costs = costs or self.op_costs
        overhead = self.op_overhead if overhead is None else overhead
        stages = range(len(self.layers) - 1)
        body = sum(costs.forward_at(s) + costs.backward_at(s) - 2 * overhead for s in stages)
        return body + costs.preprocess_forward - (overhead if costs.preprocess_forward else 0.0)

    @property
    def max_peak(self) -> int:
        return max(self.peak_bytes)


def candidates(
    costs: ModelCosts,
    pp: int,
    batch: int,
    vpps: Sequence[int] = (1, 2, 4),
    micros: Sequence[int] | None = None,
    splits: Sequence[str] = ("even", "rebalanced"),
) -> list[Candidate]:
    """Every combination that applies: MPipe options only with a preprocess, ``backward`` only
    with a trainable one and a peer rank to own it (P > 1), the rebalanced split only where the
    preprocess runs on rank 0 and the layers have a time to balance by, a ``V`` only where
    ``P·V`` stages have a layer each, an ``M`` only where it divides the batch."""
    micros = [m for m in (micros or range(pp, batch + 1)) if batch % m == 0 and m >= 1]
    vpps = [v for v in vpps if pp * v <= costs.layers]
    has_pre, trainable = costs.preprocess != "none", costs.preprocess == "trainable"
    timed = costs.layer_forward + costs.layer_backward > 0  # sizes alone: nothing to balance by
    out = []
    for vpp, micro, recompute in itertools.product(vpps, micros, (False, True)):
        out.append(Candidate("baseline", "even", vpp, micro, recompute=recompute))
        if has_pre and "rebalanced" in splits and timed:
            out.append(Candidate("baseline", "rebalanced", vpp, micro, recompute=recompute))
        if has_pre:
            for run_ahead, backward in itertools.product(
                ("full", "min"), ("central", "owner") if trainable and pp > 1 else ("central",)
            ):
                out.append(Candidate("mpipe", "even", vpp, micro, run_ahead, backward, recompute))
    return out


def predict(
    costs: ModelCosts, pp: int, batch: int, candidate: Candidate, *, dp: int = 1, zero: bool = False
) -> Predicted:
    """The candidate's step time and per-rank peak memory under ``costs``; ``zero``: each of
    the ``dp`` data-parallel replicas keeps the optimizer state of ``1/dp`` of the parameters
    (ZeRO-1: parameters and gradients stay whole)."""
    rows = batch / candidate.micro / costs.micro_batch_size  # scale of a micro-batch's costs
    layers = _layers(costs, pp, candidate, rows)
    config = PlanConfig(
        pp=pp,
        vpp=candidate.vpp,
        micro=candidate.micro,
        preprocess=costs.preprocess,
        num_preprocess_layers=0 if costs.preprocess == "none" else 1,
        run_ahead=candidate.run_ahead,
        backward=candidate.backward,
        transpose=candidate.schedule == "mpipe",
    )
    plan = build_plan(config)
    extra = costs.op_overhead
    op_costs = _op_costs(costs, candidate, layers, rows)
    step_time = simulate(plan, op_costs).step_time
    sizes = _item_sizes(costs, candidate, layers, rows)
    parts = tuple(
        {
            **_state_bytes(costs, pp, candidate, layers, r, dp if zero else 1),
            **_peak_parts(plan, r, sizes),
            "recomputed tape": _recomputed_tape(costs, pp, candidate, layers, r, rows),
        }
        for r in range(pp)
    )
    peaks = tuple(sum(p.values()) for p in parts)
    return Predicted(candidate, step_time, peaks, layers, op_costs, extra, parts)


def _op_costs(costs: ModelCosts, candidate: Candidate, layers: Sequence[int], rows: float) -> OpCosts:
    """The simulator's costs of each stage's forward and backward call, the preprocess and the
    transfers, for micro-batches of ``rows`` times the calibrated size."""
    again = 1.0 if candidate.recompute else 0.0  # recompute: the backward runs the forward first
    work = compute_scale(costs, rows)
    extra = costs.op_overhead
    # a stage between the first and the last pays its call's fixed part; a recompute reruns
    # the layers' forward inside the backward's call, not a call of its own
    chunk = [0.0 if s in (0, len(layers) - 1) else 1.0 for s in range(len(layers))]
    forward = [
        (n * costs.layer_forward + c * costs.chunk_forward) * work + extra
        for n, c in zip(layers, chunk, strict=True)
    ]
    backward = [
        (n * (costs.layer_backward + again * costs.layer_forward) + c * costs.chunk_backward) * work + extra
        for n, c in zip(layers, chunk, strict=True)
    ]
    forward[0] += costs.first_stage_forward * work
    backward[0] += (costs.first_stage_backward + again * costs.first_stage_forward) * work
    forward[-1] += costs.last_stage_forward * work  # fused: the last F is forward+loss+backward,
    backward[-1] -= extra  # one call: its overhead once
    return OpCosts(
        forward=0.0,
        backward=0.0,
        stage_forward=tuple(forward),
        stage_backward=tuple(backward),
        preprocess_forward=costs.preprocess_forward * work + extra,
        preprocess_backward=costs.preprocess_backward * work + extra,
        recompute=_preprocess_recompute(costs) * work + extra,
        latency=costs.latency,
        bandwidth=costs.bandwidth,
        activation_bytes=costs.hidden_bytes * rows,
        preprocess_bytes=costs.preprocess_output_bytes * rows,
        fused_last_stage=True,
    )


def _item_sizes(costs: ModelCosts, candidate: Candidate, layers: Sequence[int], rows: float) -> ItemSizes:
    """Bytes of what a step keeps alive per micro-batch: each stage's tape and input, the
    preprocess's output and tape."""
    return ItemSizes(
        # recompute keeps a stage's input alone; otherwise every layer's tape
        activations={
            s: round(
                (costs.hidden_bytes if candidate.recompute else n * costs.layer_activation_bytes) * rows
                + (costs.last_stage_activation_bytes * rows if s == len(layers) - 1 else 0)
            )
            for s, n in enumerate(layers)
        },
        stage_inputs={s: round(costs.hidden_bytes * rows) for s in range(len(layers))},
        preprocess_output=round(costs.preprocess_output_bytes * rows),
        preprocess_tape=round(costs.preprocess_tape_bytes * rows),
    )


def tune(
    costs: ModelCosts | str,
    pp: int,
    batch: int,
    memory_budget: int | None = None,
    vpps: Sequence[int] = (1, 2, 4),
    micros: Sequence[int] | None = None,
    splits: Sequence[str] = ("even", "rebalanced"),
    *,
    size: str = "tiny",
    dp: int = 1,
    zero: bool = False,
) -> list[Predicted]:
    """Every candidate that fits ``memory_budget`` bytes per rank (``None``: any), fastest
    first (ties: the smaller peak). Raises :class:`NoPlanFitsError` naming the smallest peak.

    ``costs``: a :class:`ModelCosts`, or the name of a built-in example (``size``: its preset),
    calibrated first in this process (:func:`graph_exec.harness.model_costs.example_costs`:
    needs MindSpore; transfers are then taken as free, which ``graph-exec tune EXAMPLE``
    measures instead). ``dp`` and ``zero``: see :func:`predict` (ZeRO needs ``dp >= 2``)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    if zero and dp < 2:
        raise ValueError(
            f"ZeRO-1 shards the optimizer state over the data-parallel replicas: it needs dp >= 2, got dp={dp}"
        )
    if isinstance(costs, str):
        costs, splits = _example_costs(costs, size, pp, batch, splits)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an integer >= 1, got {pp!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget!r}")
    every = [
        predict(costs, pp, batch, c, dp=dp, zero=zero)
        for c in candidates(costs, pp, batch, vpps, micros, splits)
    ]
    # a rebalanced split that moved nothing is the even baseline again: one of them is enough
    evens = {
        (p.candidate.vpp, p.candidate.micro, p.candidate.recompute, p.layers)
        for p in every
        if p.candidate.split == "even" and p.candidate.schedule == "baseline"
    }
    every = [
        p
        for p in every
        if p.candidate.split == "even"
        or (p.candidate.vpp, p.candidate.micro, p.candidate.recompute, p.layers) not in evens
    ]
    if not every:
        raise ValueError(
            f"no candidate plan: {costs.layers} layers over {pp} ranks with V in {list(vpps)} and a "
            f"batch of {batch} (M must divide it)"
        )
    fitting = [p for p in every if memory_budget is None or p.max_peak <= memory_budget]
    if not fitting:
        smallest = min(every, key=lambda p: p.max_peak)
        raise NoPlanFitsError(
            f"no plan fits {memory_budget} bytes ({memory_budget / 2**20:.1f} MiB) per rank: the smallest "
            f"predicted peak is {smallest.max_peak} bytes ({smallest.max_peak / 2**20:.1f} MiB), with "
            f"{smallest.candidate.describe()}"
        )
    return sorted(fitting, key=lambda p: (p.step_time, p.max_peak))


#: The built-in examples whose ``build`` takes a per-stage ``layers`` split (the rebalanced one).
SPLITTABLE = ("qwen2vl", "llama")


def _example_costs(
    example: str, size: str, pp: int, batch: int, splits: Sequence[str]
) -> tuple[ModelCosts, tuple[str, ...]]:
    """A built-in example calibrated here (one micro-batch of ``batch / pp`` rows)."""
    from graph_exec.examples import EXAMPLES

    if example not in EXAMPLES:
        raise ValueError(f"unknown example {example!r}; choose one of: {', '.join(EXAMPLES)}")
    from graph_exec.harness.model_costs import example_costs
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore()
    costs = example_costs(example, size, max(batch // pp, 1), layers=0)
    allowed = tuple(s for s in splits if s == "even" or example in SPLITTABLE)
    return costs, allowed


def _layers(costs: ModelCosts, pp: int, candidate: Candidate, rows: float) -> tuple[int, ...]:
    if candidate.split == "even":
        return even_layers(costs.layers, pp * candidate.vpp)
    layer = costs.layer_forward + costs.layer_backward
    tower = costs.preprocess_forward + (costs.preprocess_backward if costs.preprocess == "trainable" else 0)
    return rebalanced_layers(costs.layers, pp, candidate.vpp, layer * rows, [tower * rows])


def compute_scale(costs: ModelCosts, k: float) -> float:
    """What a micro-batch of ``k`` times the calibrated rows costs, in calibrated micro-batches:
    the measured points (and ``(1, 1)``) interpolated where ``k`` lies among them, the fixed
    share's line beyond them."""
    points = sorted({(1.0, 1.0), *costs.scale_points})
    if points[0][0] <= k <= points[-1][0]:
        for (k0, s0), (k1, s1) in itertools.pairwise(points):
            if k0 <= k <= k1:
                return s0 if k1 == k0 else s0 + (s1 - s0) * (k - k0) / (k1 - k0)
    return costs.fixed_share + (1 - costs.fixed_share) * k


def _preprocess_recompute(costs: ModelCosts) -> float:
    if costs.preprocess_recompute is None:
        return costs.preprocess_forward + costs.preprocess_backward
    return costs.preprocess_recompute


def _state_bytes(
    costs: ModelCosts, pp: int, candidate: Candidate, layers: Sequence[int], rank: int, shards: int = 1
) -> dict[str, int]:
    """Parameters, gradient accumulators and optimizer state of ``rank`` (the optimizer state
    over ``shards`` replicas: ZeRO-1 balances it by bytes, so each keeps ``1/shards``)."""
    own = sum(n for s, n in enumerate(layers) if s % pp == rank) * costs.layer_param_bytes
    own += costs.first_stage_param_bytes if rank == 0 else 0
    own += costs.last_stage_param_bytes if (len(layers) - 1) % pp == rank else 0
    trained = own
    runs_preprocess = costs.preprocess != "none" and (candidate.schedule == "mpipe" or rank == 0)
    held = own + (costs.preprocess_param_bytes if runs_preprocess else 0)
    if costs.preprocess == "trainable" and (rank == 0 or candidate.backward == "owner"):
        trained += costs.preprocess_param_bytes
    return {
        "parameters": round(held),
        "gradients": round(trained * costs.gradient_bytes_per_param_byte),
        "optimizer": -(-round(trained * costs.optimizer_bytes_per_param_byte) // shards),
    }


def _recomputed_tape(
    costs: ModelCosts, pp: int, candidate: Candidate, layers: Sequence[int], rank: int, rows: float
) -> int:
    """With ``recompute``, a backward reruns its stage's forward under the tape and reads it:
    the largest of ``rank``'s stage tapes is held during that step, beside what the plan holds
    (counted on top of the peak: an upper bound where the peak is not at a backward)."""
    if not candidate.recompute:
        return 0
    return round(max(n for s, n in enumerate(layers) if s % pp == rank) * costs.layer_activation_bytes * rows)


def _peak_parts(plan: Plan, rank: int, sizes: ItemSizes) -> dict[str, int]:
    """What ``rank`` holds of each kind at the step where the total peaks (the first such)."""
    length = len(plan.order_codes[rank]) + 1
    deltas = {kind: [0] * (length + 1) for kind in KINDS}
    for item in held_items(plan, rank):
        deltas[item.kind][item.start] += sizes.of(item)
        deltas[item.kind][item.end + 1] -= sizes.of(item)
    running = {kind: list(itertools.accumulate(delta)) for kind, delta in deltas.items()}
    totals = [sum(running[kind][i] for kind in KINDS) for i in range(length)]
    peak = max(range(length), key=totals.__getitem__)
    return {kind: running[kind][peak] for kind in KINDS}


def table(results: Iterable[Predicted], top: int = 10) -> str:
    """The best ``top`` candidates, one line each: predicted step and every rank's peak."""
    lines = []
    for k, p in enumerate(itertools.islice(results, top), 1):
        peaks = " ".join(f"{b / 2**20:.1f}" for b in p.peak_bytes)
        lines.append(f"{k:2d}. {p.candidate.describe():<62} step {p.step_time:.6g}  peak MiB/rank {peaks}")
    return "\n".join(lines) + "\n"
