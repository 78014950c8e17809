"""Executors: the hook interface and its graph and pynative implementations.

``create_executor(mode, stages, ...)`` is the one entry point; ``mode="graph"`` compiles every
kernel with ``mindspore.jit``, ``mode="pynative"`` runs the same kernels eagerly for debugging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .base import CompileStats, Executor
from .errors import (
    ExecutorConfigError,
    ExecutorError,
    HookArgumentError,
    HookOrderError,
    HookTypeError,
    UnknownStageError,
)

if TYPE_CHECKING:
    from mindspore import nn

#: The accepted ``mode`` values.
MODES = ("graph", "pynative")


def create_executor(
    mode: str,
    stages: Mapping[int, nn.Cell],
    *,
    preprocess: nn.Cell | None = None,
    loss_fn: Callable[..., Any] | None = None,
    last_stage: int | None = None,
    loss_scale: float = 1.0,
    bucketing: Any = None,
) -> Executor:
    """The executor for one rank.

    ``stages`` maps virtual stage index to the chunk this rank runs; ``preprocess`` is the
    replicated preprocess block; ``loss_fn(output, *labels)`` makes the loss on the last stage
    (``None``: the last chunk returns the scalar loss itself, called as
    ``chunk(*inputs, *labels)``); ``last_stage`` is the index of the model's last stage
    (default: the highest index in ``stages``); gradients are those of ``loss_scale * loss``.
    ``bucketing`` (padding shapes up to buckets to bound recompiles) is not supported: padding
    is only loss- and gradient-neutral for models whose rows and positions are independent,
    which an executor cannot check; pass ``None``.
    """
    if mode not in MODES:
        raise ExecutorConfigError(f"unknown executor mode {mode!r}; expected one of {', '.join(MODES)}")
    if bucketing is not None:
        raise ExecutorConfigError(
            "shape bucketing is not supported: padding changes losses and gradients of models whose "
            "batch rows or positions interact (batch norm, mean losses, non-causal attention)"
        )
    if mode == "graph":
        from .graph import GraphExecutor as chosen
    else:
        from .pynative import PynativeExecutor as chosen
    return chosen(
        stages, preprocess=preprocess, loss_fn=loss_fn, last_stage=last_stage, loss_scale=loss_scale
    )


__all__ = [
    "MODES",
    "CompileStats",
    "Executor",
    "ExecutorConfigError",
    "ExecutorError",
    "HookArgumentError",
    "HookOrderError",
    "HookTypeError",
    "UnknownStageError",
    "create_executor",
]
