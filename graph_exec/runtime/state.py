"""Per-step caches of one rank: what one step leaves for a later step to consume.

Every entry is put by exactly one step and taken by exactly one later step of the same
training step, so all caches are empty between steps. Anything left over means the plan and
the runtime disagree; it is reported by name instead of silently leaking memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

Key = tuple[int, int]  # (stage, micro)


@dataclass
class StepCaches:
    """Tensors in flight between the steps of one rank's order."""

    body_inputs: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # F s.m reads
    outputs: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # Fsend s.m reads
    cotangents: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # B s.m reads
    input_grads: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # Bsend s.m reads
    preprocess_outputs: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # OUTsend m reads
    preprocess_grads: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # TBWD / GRADsend m read
    shipped_inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = field(
        default_factory=dict
    )  # TBWD m reads
    losses: dict[int, Any] = field(default_factory=dict)  # returned to the caller, then cleared

    def leftovers(self) -> list[str]:
        """``cache[keys]`` for every non-empty cache except the losses (those are the result)."""
        return [
            f"{f.name}{sorted(getattr(self, f.name))}"
            for f in fields(self)
            if f.name != "losses" and getattr(self, f.name)
        ]

    def clear(self) -> None:
        for f in fields(self):
            getattr(self, f.name).clear()
