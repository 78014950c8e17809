"""A communication group as a value: its name and ranks.

Below both :mod:`.comm` (which runs collectives on a group) and :mod:`.mesh` (which lays the
groups out and makes them), so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommGroup:
    """One communication group: its MindSpore name and its global ranks, in group-rank order."""

    name: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """The group rank of ``global_rank`` (its position in :attr:`ranks`)."""
        return self.ranks.index(global_rank)
