"""Cost-aware placement of the preprocess towers ("data re-ordering").

The rules are ``docs/schedule.md``, "Tower placement". A plan fixes, for every plan micro-batch
``m``, who runs its preprocess forward (``TFWD m``) and where in that rank's order. A step's
micro-batches usually differ in tower cost (a VLM micro-batch's image patches), so which user
micro-batch becomes plan micro ``m`` decides how much tower time lands where. This module
chooses that assignment, a permutation ``order`` with ``order[m]`` = the user micro-batch that
runs as plan micro ``m``; the plan itself is not changed.

Two kinds of position (:func:`tower_positions`):

- **prefix**: ``TFWD m`` in its owner's prefix. Rank 0 receives every transposed output before
  its first ``F 0.0``, so the body starts when the most loaded owner is done: these positions
  are balanced over the owners (longest tower first onto the least loaded owner, then pairwise
  swaps), ties going to ranks other than 0.
- **inline**: ``TFWD m`` on rank 0 right before ``F 0.m`` (``run_ahead="min"``, or no
  transposition). It is on rank 0's path except where rank 0 would wait anyway; that *slack*
  is measured once per plan by a critical-path pass over the plan's replay
  (:mod:`.walk`), every step priced by the one cost rule (:mod:`.costs`; by default ``F`` = 1,
  ``B`` = 2, a split backward's ``I`` and ``W`` 1 each, the towers free). The lightest micro-batches go inline, the heavier of them where the slack is
  larger.

The decision is a pure function of the configuration and the cost vector, so every rank that
holds the same costs reaches it without a message. It never returns an order that its own
model (the slowest owner's prefix plus each inline tower's excess over its slack) rates worse
than arrival order; on a tie it keeps arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from graph_exec.schedule import codes
from graph_exec.schedule.codes import PAIR_DELTA, is_recv, kind_base
from graph_exec.schedule.config import PlanConfig, PlanConfigError
from graph_exec.schedule.costs import OpCosts, step_cost
from graph_exec.schedule.mpipe import inline_micros
from graph_exec.schedule.plan import build_plan
from graph_exec.schedule.walk import walk

#: The accepted ``tower_order`` values: ``"arrival"`` keeps the user's order.
TOWER_ORDERS = ("arrival", "balanced")

#: Most pairwise-swap rounds after the greedy balance (each strictly lowers the top load).
_SWAP_ROUNDS = 64


#: What the runtime's decision assumes without measuring, in units of one chunk forward: the
#: textbook forward : backward ratio (a split backward's ``I`` and ``W`` half of it each), the
#: last stage's forward, loss and backward fused into its ``F`` (as the runtime runs it), free
#: transfers. The simulator passes its own costs.
RUNTIME_COSTS = OpCosts(forward=1.0, backward=2.0, fused_last_stage=True)


def StepCosts(  # CapWords: the name users have passed since before OpCosts was the one cost type
    backward: float = 2.0,
    fused_last_stage: bool = True,
    transfer: float = 0.0,
    tower_transfer: float = 0.0,
    input_backward: float | None = None,
    weight_backward: float | None = None,
) -> OpCosts:
    """Costs in units of one chunk forward (``F`` = 1), as :class:`OpCosts`.

    ``transfer`` is how long a body message travels (``Fsend``/``Bsend`` to its receive),
    ``tower_transfer`` an ``OUT``/``IN``/``GRAD`` one; the defaults are :data:`RUNTIME_COSTS`.
    """
    return OpCosts(
        forward=1.0,
        backward=backward,
        input_backward=input_backward,
        weight_backward=weight_backward,
        fused_last_stage=fused_last_stage,
        bandwidth=1.0,  # a message of n "bytes" then travels n units
        activation_bytes=transfer,
        preprocess_bytes=tower_transfer,
    )


@dataclass(frozen=True)
class TowerPositions:
    """Where a plan runs its preprocess forwards, as :func:`balanced_order` needs it.

    ``prefix[r]``: the plan micros whose ``TFWD`` rank ``r`` runs in its prefix, ascending.
    ``inline``: the plan micros whose ``TFWD`` rank 0 runs right before ``F 0.m``, ascending.
    ``slack[i]``: how long ``TFWD inline[i]`` alone may take, in the costs' time unit, before it
    delays the step.
    """

    micro: int
    prefix: tuple[tuple[int, ...], ...]
    inline: tuple[int, ...]
    slack: tuple[float, ...]
    tower_transfer: float = 0.0  #: what an owner other than rank 0 adds: shipping its output


def placement_config(config: PlanConfig) -> PlanConfig:
    """The configuration the decision is made on: ``config`` with a frozen one-layer preprocess.

    The tower positions do not depend on the preprocess kind, but rank 0 of the fair baseline
    knows its preprocess while the other ranks may not (they build a body-only plan); deciding
    on one normalised configuration gives every rank the same answer.
    """
    return replace(
        config, preprocess="frozen", num_preprocess_layers=1, backward="central", input="replicated"
    )


def tower_positions(config: PlanConfig, costs: OpCosts = RUNTIME_COSTS) -> TowerPositions:
    """The prefix and inline positions of ``config``'s plan, with each inline position's slack
    under ``costs`` (the towers' costs aside: the slack is what a tower may take)."""
    config = placement_config(config)
    inline = inline_micros(config)
    owners = config.nt if config.transpose else 1
    prefix = tuple(tuple(m for m in config.owned(r) if m not in inline) for r in range(owners))
    ordered_inline = tuple(sorted(inline))
    slack: tuple[float, ...] = ()
    if ordered_inline:
        slack_of = _tfwd_slack(build_plan(config).order_codes, config, costs)
        slack = tuple(slack_of[m] for m in ordered_inline)
    return TowerPositions(config.micro, prefix, ordered_inline, slack, costs.transfer_time(codes.OUTSEND))


def check_tower_costs(
    costs: Sequence[float], micro: int, error: type[Exception] = PlanConfigError
) -> tuple[float, ...]:
    """``costs`` as floats: one finite number >= 0 per micro-batch, or ``error`` naming the bad one."""
    if isinstance(costs, str | bytes) or not isinstance(costs, Sequence):
        raise error(
            f"tower_costs must be a sequence of {micro} numbers (one per micro-batch), got {type(costs).__name__}"
        )
    if len(costs) != micro:
        raise error(
            f"tower_costs has {len(costs)} values but there are {micro} micro-batches: pass one per micro-batch"
        )
    out = []
    for index, value in enumerate(costs):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise error(f"tower_costs[{index}] = {value!r}: each must be a finite number >= 0")
        out.append(float(value))
    return tuple(out)


def tower_order(positions: TowerPositions, costs: Sequence[float], mode: str) -> tuple[int, ...]:
    """``order[m]``: the user micro-batch that runs as plan micro ``m`` (``"arrival"``: identity)."""
    if mode not in TOWER_ORDERS:
        raise PlanConfigError(f"tower_order must be one of {TOWER_ORDERS}, got {mode!r}")
    costs = check_tower_costs(costs, positions.micro)
    if mode == "arrival":
        return tuple(range(positions.micro))
    return balanced_order(positions, costs)


def balanced_order(positions: TowerPositions, costs: Sequence[float]) -> tuple[int, ...]:
    """The balanced assignment (module docstring); arrival order unless it is rated better."""
    micro = positions.micro
    users = sorted(range(micro), key=lambda u: (-costs[u], u))  # heaviest first, stable
    size = sum(len(p) for p in positions.prefix)
    order = [0] * micro
    groups = _balance(
        [costs[u] for u in users[:size]], [len(p) for p in positions.prefix], positions.tower_transfer
    )
    heavy = users[:size]
    for rank, members in enumerate(groups):
        members.sort(key=lambda i: (-costs[heavy[i]], heavy[i]))
        for m, i in zip(positions.prefix[rank], members, strict=True):
            order[m] = heavy[i]
    by_slack = sorted(range(len(positions.inline)), key=lambda i: (-positions.slack[i], -positions.inline[i]))
    for i, user in zip(by_slack, users[size:], strict=True):
        order[positions.inline[i]] = user
    arrival = tuple(range(micro))
    balanced = tuple(order)
    if modelled_cost(positions, costs, balanced) < modelled_cost(positions, costs, arrival):
        return balanced
    return arrival


def modelled_cost(positions: TowerPositions, costs: Sequence[float], order: Sequence[int]) -> float:
    """What the decision minimises: the most loaded owner's prefix towers, plus each inline
    tower's excess over its slack."""
    prefix = max(
        (
            sum(costs[order[m]] for m in ms) + (positions.tower_transfer if rank and ms else 0.0)
            for rank, ms in enumerate(positions.prefix)
        ),
        default=0.0,
    )
    inline = sum(
        max(0.0, costs[order[m]] - s) for m, s in zip(positions.inline, positions.slack, strict=True)
    )
    return prefix + inline


def _balance(weights: Sequence[float], capacity: Sequence[int], transfer: float) -> list[list[int]]:
    """Indices of ``weights`` (heaviest first) split into groups of the given sizes, the largest
    group sum as small as the greedy and a few swaps make it; every group but rank 0's starts
    at ``transfer`` (its outputs still have to reach rank 0)."""
    groups: list[list[int]] = [[] for _ in capacity]
    loads = [0.0] + [transfer if size else 0.0 for size in capacity[1:]]
    for i, weight in enumerate(weights):
        open_ranks = [r for r in range(len(capacity)) if len(groups[r]) < capacity[r]]
        # least loaded first; on a tie a rank other than 0, the highest (rank 0 stays lightest)
        rank = min(open_ranks, key=lambda r: (loads[r], r == 0, -r))
        groups[rank].append(i)
        loads[rank] += weight
    for _ in range(_SWAP_ROUNDS):
        top = max(range(len(loads)), key=lambda r: loads[r])
        best: tuple[float, int, int, int] | None = None
        for other in range(len(loads)):
            if other == top:
                continue
            for x in groups[top]:
                for y in groups[other]:
                    moved = weights[x] - weights[y]
                    if moved > 0 and loads[other] + moved < loads[top]:
                        peak = max(loads[top] - moved, loads[other] + moved)
                        if best is None or peak < best[0]:
                            best = (peak, other, x, y)
        if best is None:
            break
        _, other, x, y = best
        moved = weights[x] - weights[y]
        groups[top][groups[top].index(x)] = y
        groups[other][groups[other].index(y)] = x
        loads[top] -= moved
        loads[other] += moved
    return groups


def _tfwd_slack(rows: Sequence[Sequence[int]], config: PlanConfig, costs: OpCosts) -> dict[int, float]:
    """Per ``TFWD m`` on rank 0: latest minus earliest start (the critical-path method).

    Earliest starts are the replay of the orders (:func:`~graph_exec.schedule.walk.walk`)
    under ``costs`` with every tower free; latest starts walk that replay backwards from the
    step's end: a step must end before its successor on the rank starts, a send before its
    receive's latest start less the message's travel, and a collective's ranks share one.
    """
    free = replace(costs, preprocess_forward=0.0, recompute=0.0, preprocess_backward=0.0, tower_costs=())
    cost = step_cost(free, config, (0.0,) * config.micro)
    replay = walk(rows, cost, record=True)
    if not replay.complete(rows):
        raise PlanConfigError("the slack pass could not replay the plan (validate it first)")
    receiver = {c: (r, i) for r, row in enumerate(rows) for i, c in enumerate(row) if is_recv(c)}
    end = max((row[-1][2] for row in replay.steps if row), default=0.0)
    latest = [[0.0] * len(row) for row in rows]
    for group in reversed(replay.replay):
        finishes = []
        for rank, index in group:
            code = rows[rank][index]
            finish = latest[rank][index + 1] if index + 1 < len(rows[rank]) else end
            kind = kind_base(code)
            if kind in PAIR_DELTA:  # takes no time on the sender; the message travels cost(code)
                to_rank, to_index = receiver[code + PAIR_DELTA[kind]]
                finishes.append(min(finish, latest[to_rank][to_index] - cost(code)))
            else:
                finishes.append(finish - cost(code))
        shared = min(finishes)
        for rank, index in group:
            latest[rank][index] = shared
    return {
        codes.micro_of(code): latest[0][i] - replay.steps[0][i][1]
        for i, code in enumerate(rows[0])
        if kind_base(code) == codes.TFWD
    }
