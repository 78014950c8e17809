"""The memory lines of the ``run`` and ``bench`` summaries: one per rank, from its record.

Each rank's record carries its ``stats()["memory"]`` after its last step (``docs/api.md``
lists the keys); this module only formats it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from graph_exec.report.records import RankRecord


def size_text(nbytes: int | None) -> str:
    """``nbytes`` in the largest binary unit that keeps it at or above 1 (``-`` for ``None``)."""
    if nbytes is None:
        return "-"
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def memory_line(rank: int, memory: Mapping[str, Any]) -> str:
    """One rank's memory: the fixed parts, the step's peaks, the process's peaks."""
    stages = ", ".join(f"{s}: {size_text(b)}" for s, b in memory["activations_per_stage"].items())
    optimizer = memory["optimizer_state"]
    parts = [
        f"params {size_text(memory['parameters'])}",
        f"grads {size_text(memory['gradient_accumulators'])}",
        f"optimizer {'not seen' if optimizer is None else size_text(optimizer)}",
        f"activations {size_text(memory['activations'])}" + (f" (per stage {stages})" if stages else ""),
        f"receives {size_text(memory['receive_slots'])}",
        f"preprocess outputs {size_text(memory['preprocess_outputs'])}",
    ]
    for key, name in (("preprocess_tapes", "preprocess tapes"), ("held_weight_gradients", "held W grads")):
        if memory[key]:
            parts.append(f"{name} {size_text(memory[key])}")
    parts.append(f"held peak {size_text(memory['held_peak'])}")
    process = f"peak RSS {size_text(memory['peak_rss'])}"
    if memory["allocator_peak"] is not None:
        process += f", allocator peak {size_text(memory['allocator_peak'])}"
    return f"rank {rank}: " + ", ".join(parts) + f"; {process}"


def memory_lines(records: Sequence[RankRecord]) -> list[str]:
    """The memory line of every rank whose record has one, by rank."""
    return [memory_line(r.rank, r.memory) for r in sorted(records, key=lambda r: r.rank) if r.memory]
