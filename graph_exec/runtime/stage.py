"""``PipelineStage``: one virtual stage (model chunk) held by this rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graph_exec import checks


@dataclass(frozen=True)
class PipelineStage:
    """A model chunk and its place in the pipeline.

    With ``P`` pipeline ranks and ``V`` chunks per rank, ``num_stages = P * V`` and stage ``s``
    lives on rank ``s mod P`` (so a rank holds stages ``r, r + P, …``).

    Args:
        submodule: the chunk, a ``mindspore.nn.Cell``; for stage 0 the *body* only (the
            preprocess block is passed to the schedule separately).
        stage_index: this chunk's global stage index, in ``[0, num_stages)``.
        num_stages: the number of stages of the whole pipeline (``P * V``).
    """

    submodule: Any
    stage_index: int
    num_stages: int

    def __post_init__(self) -> None:
        from mindspore import nn

        if not isinstance(self.submodule, nn.Cell):
            raise TypeError(f"submodule must be a mindspore.nn.Cell, got {type(self.submodule).__name__}")
        checks.integer("stage_index", self.stage_index, TypeError)
        checks.integer("num_stages", self.num_stages, TypeError)
        checks.positive_int("num_stages", self.num_stages)
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index must be in [0, {self.num_stages}), got {self.stage_index}")

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1
