"""What every runnable example provides, so ``graph-exec run`` and ``bench`` can drive any of them.

An example builds its whole model split into ``num_stages`` body chunks plus the replicated
preprocess block, and makes synthetic batches that are identical on every rank (each rank
seeds the generator with the step number). ``baseline_stages`` folds the preprocess into
stage 0: the same model run as a plain interleaved-1F1B pipeline, to measure MPipe against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, nn


class PrefixedChunk(nn.Cell):
    """``body(preprocess(x))`` as one chunk: stage 0 of the baseline without MPipe."""

    def __init__(self, preprocess: nn.Cell, body: nn.Cell) -> None:
        super().__init__()
        self.preprocess = preprocess
        self.body = body

    def construct(self, *inputs: Tensor) -> Any:
        out = self.preprocess(*inputs)
        return self.body(*out) if isinstance(out, tuple) else self.body(out)


@dataclass
class ExampleModel:
    """A model ready to be pipelined, and its data."""

    preprocess: nn.Cell | None
    num_transpose_layers: int
    stages: list[nn.Cell]
    loss_fn: Callable[..., Tensor]
    make_batch: Callable[[int, int], tuple[tuple[Tensor, ...], Tensor]]
    summary: str

    def batch(self, step: int, batch_size: int) -> tuple[tuple[Tensor, ...], Tensor]:
        """``(inputs, labels)`` of training step ``step`` (the same on every rank)."""
        return self.make_batch(step, batch_size)

    def baseline_stages(self) -> list[nn.Cell]:
        """The body chunks with the preprocess folded into stage 0 (no MPipe)."""
        if self.preprocess is None:
            return list(self.stages)
        return [PrefixedChunk(self.preprocess, self.stages[0]), *self.stages[1:]]


@dataclass(frozen=True)
class Example:
    """A named model family: ``build(num_stages, trainable_preprocess, seed)``."""

    name: str
    description: str
    build: Callable[..., ExampleModel]
    #: Whether the preprocess is trainable by default (``--frozen``/``--trainable`` override).
    trainable_by_default: bool
