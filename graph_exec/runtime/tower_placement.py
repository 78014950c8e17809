"""One tower placement per step, the same for training and evaluation, and its wire tag.

**One placement for both plans.** With ``input="owned"`` a rank reads only the micro-batches
placed on it (``owned_input()``, the owned ``DataLoader``), before it knows whether the batch
goes to ``run()`` or ``evaluate()``. The forward-only plan has the same owners
(``PlanConfig.owned`` does not depend on ``forward_only``) but a different critical path, so a
placement decided on its own slack differs from the training one for some cost vectors (at
P = 2, M = 4, ``run_ahead="min"``: about one in four): the rank would feed the tower rows it never
read. :class:`TowerPlacement` therefore decides every step on the training plan's positions.

**The placement travels with the step's messages.** Every rank decides alone from the
``tower_costs`` it was given; costs that differ by one rounding step between ranks would pair
inputs and labels wrongly without a word. :func:`placement_tag` turns the placement into a
31-bit tag that the transport stamps into every transfer of the step (beside the sequence
number: no new message, no new collective) and checks on every receive, so the first transfer
between two ranks that disagree fails on the receiver, which tells every peer. For up to
:data:`EXACT_MICROS` micro-batches the tag *is* the placement (its rank among the
permutations), so the error names both placements; above that it is a digest.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import replace

from graph_exec.schedule import PlanConfig, placement
from graph_exec.schedule.placement import TowerPositions

#: Up to this many micro-batches a placement is its own tag (12! < 2**30).
EXACT_MICROS = 12
#: Tags of digests have this bit set; exact tags stay below it.
_DIGEST_BIT = 1 << 30


class TowerPlacement:
    """The placement of ``micro`` micro-batches under ``mode`` (a ``tower_order`` value), the
    training plan's positions computed once."""

    def __init__(self, micro: int, mode: str) -> None:
        self.micro = micro
        self.mode = mode
        self._positions: TowerPositions | None = None

    def order(self, config: PlanConfig, costs: Sequence[float] | None) -> tuple[int, ...]:
        """``order[m]``: the batch's micro-batch that plan micro ``m`` runs, for ``config``'s
        training plan or its forward-only plan alike (the module docstring says why)."""
        if costs is None or self.mode == "arrival":
            return tuple(range(self.micro))
        if self._positions is None:
            self._positions = placement.tower_positions(replace(config, forward_only=False))
        return placement.tower_order(self._positions, costs, self.mode)


def placement_tag(order: Sequence[int]) -> int:
    """A 31-bit tag of ``order``: 0 for arrival order, its rank among the permutations (plus
    one bit of room) up to :data:`EXACT_MICROS` micro-batches, else a digest."""
    if len(order) > EXACT_MICROS:
        if list(order) == list(range(len(order))):
            return 0
        return _DIGEST_BIT | (zlib.crc32(bytes(str(tuple(order)), "ascii")) & (_DIGEST_BIT - 1))
    rank, left = 0, sorted(order)
    for position, value in enumerate(order):
        index = left.index(value)
        rank += index * math.factorial(len(order) - 1 - position)
        left.pop(index)
    return rank


def describe_tag(tag: int, micro: int) -> str:
    """The placement a tag of :func:`placement_tag` stands for, in words."""
    if tag & _DIGEST_BIT:
        return f"a tower placement with digest {tag & (_DIGEST_BIT - 1):#x}"
    left, order = list(range(micro)), []
    for position in range(micro):
        index, tag = divmod(tag, math.factorial(micro - 1 - position))
        order.append(left.pop(index))
    return f"tower placement order {tuple(order)}"
