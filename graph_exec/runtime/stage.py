"""``PipelineStage``: one virtual stage (model chunk) held by this rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


@dataclass(frozen=True)
class PipelineStage:
    """A model chunk and its place in the pipeline: global ``stage_index`` of ``num_stages``.

    With ``P`` pipeline ranks and ``V`` chunks per rank, ``num_stages = P * V`` and stage ``s``
    lives on rank ``s mod P`` (so a rank holds stages ``r, r + P, …``). The first stage's chunk
    is the *body* of stage 0: the preprocess block is passed to the schedule separately.
    """

    submodule: Any
    stage_index: int
    num_stages: int

    def __post_init__(self) -> None:
        from mindspore import nn

        if not isinstance(self.submodule, nn.Cell):
            raise TypeError(f"submodule must be a mindspore.nn.Cell, got {type(self.submodule).__name__}")
        _index("stage_index", self.stage_index)
        if _index("num_stages", self.num_stages) < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index must be in [0, {self.num_stages}), got {self.stage_index}")

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1
