"""How long each received buffer must live, per rank.

The runtime releases a receive buffer after the last step that reads it, and the buffer
pool's static slot planner assigns slots from the same intervals, so both must agree on
one rule set:

- ``Frecv s.m`` is a stage input. The backward recomputes the stage forward from its input
  (stage-granular recomputation), so it lives until ``B s.m`` — except on the last stage,
  whose fused forward+loss+backward runs at ``F s.m``;
- ``Brecv s.m`` (the gradient of stage ``s``'s output) is read by ``B s.m``;
- ``OUTrecv m`` is stage 0's body input: like ``Frecv``, until ``B 0.m`` (``F 0.m`` if
  stage 0 is also the last stage);
- ``INrecv m`` (the raw input kept for recomputation) is read by ``TBWD m``;
- ``GRADrecv+bwd m`` consumes its gradient in the same step;
- in a forward-only plan there is no backward: ``Frecv s.m`` and ``OUTrecv m`` are read by
  the forward ``F s.m`` / ``F 0.m`` alone;
- with the split backward (``body="zb"``) a stage input is also the input of the stage's first
  layer, which ``W s.m`` reads to form that layer's weight gradient: ``Frecv s.m`` and
  ``OUTrecv m`` live until ``W s.m`` / ``W 0.m`` (the last stage too: its fused ``F`` leaves the
  weight gradients to ``W``), and ``Brecv s.m`` is read by ``I s.m`` (what ``W`` needs of the
  output gradients ``I`` keeps itself: ``schedule.memory``'s "output gradients").
"""

from __future__ import annotations

from dataclasses import dataclass

from graph_exec.schedule import codes
from graph_exec.schedule.codes import is_recv, kind_base, micro_of, stage_of
from graph_exec.schedule.plan import Plan
from graph_exec.schedule.steps import Step


@dataclass(frozen=True, slots=True)
class BufferLifetime:
    """One receive buffer: received at ``recv_index``, last read at ``last_index``.

    Both are indices into ``plan.orders[rank]``; ``last_index >= recv_index``.
    """

    step: Step
    recv_index: int
    last_index: int


def last_reader(code: int, last_stage: int, forward_only: bool, split_backward: bool = False) -> int:
    """The code of the last step that reads what ``code`` receives (``split_backward``: the plan's
    backward is ``I`` + ``W``, ``PlanConfig.split_backward``)."""
    kind = kind_base(code)
    if kind == codes.FRECV:
        fwd = code - codes.FRECV + codes.F
        if split_backward:
            return fwd - codes.F + codes.W
        return fwd if stage_of(code) == last_stage or forward_only else fwd - codes.F + codes.B
    if kind == codes.BRECV:
        return code - codes.BRECV + (codes.I if split_backward else codes.B)
    m = micro_of(code)
    if kind == codes.OUTRECV:
        if split_backward:
            return codes.W | m
        return codes.F | m if last_stage == 0 or forward_only else codes.B | m
    if kind == codes.INRECV:
        return codes.TBWD | m
    return code  # GRADrecv+bwd


def buffer_lifetimes(plan: Plan, rank: int) -> list[BufferLifetime]:
    """Every receive of ``rank`` with the index of its last reader, in order."""
    row = plan.order_codes[rank]
    index = {code: i for i, code in enumerate(row)}
    lifetimes = []
    for i, code in enumerate(row):
        if is_recv(code):
            reader = last_reader(code, plan.last_stage, plan.config.forward_only, plan.config.split_backward)
            lifetimes.append(BufferLifetime(codes.decode(code), i, index[reader]))
    return lifetimes
