"""Parameter names must be unique on a rank: checked when the schedule is built.

The executors key gradient buffers, ``grads()`` and the preprocess broadcast by parameter
name, and MindSpore requires unique names within one compiled graph. Two different
Parameters with one name — typically chunks kept in a plain Python list, which MindSpore does
not register as sub-cells, so each chunk names its weights from itself (``fc1.weight``) —
would otherwise fail late, at the first ``run()`` on some rank, or be silently merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graph_exec.runtime.stage import PipelineStage

_FIX = (
    "give every chunk's parameters a distinct prefix, e.g. chunk.update_parameters_name(f'stage{s}.') "
    "before building the PipelineStage, or keep the chunks in an nn.CellList (names then start with "
    "the chunk's index)"
)


def check_unique_parameter_names(stages: Sequence[PipelineStage], preprocess: Any | None) -> None:
    """Raise ``ValueError`` naming the first name two different Parameters share on this rank."""
    owners: list[tuple[str, Any]] = [(f"stage {s.stage_index}", s.submodule) for s in stages]
    if preprocess is not None:
        owners.append(("the preprocess module", preprocess))
    seen: dict[str, tuple[str, Any]] = {}
    for owner, cell in owners:
        for param in cell.get_parameters():
            first = seen.setdefault(param.name, (owner, param))
            if first[1] is not param:
                where = f"twice in {owner}" if first[0] == owner else f"in {first[0]} and in {owner}"
                raise ValueError(
                    f"duplicate parameter name {param.name!r}: two different Parameters carry it ({where}). "
                    f"Gradients and updates are keyed by name, so one would hide the other: {_FIX}"
                )
