"""Executors: the hook interface and its graph and pynative implementations.

``create_executor(mode, stages, ...)`` is the one entry point; ``mode="graph"`` compiles every
kernel with ``mindspore.jit``, ``mode="pynative"`` runs the same kernels eagerly for debugging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from graph_exec import checks

from .base import CompileStats, Executor
from .errors import (
    ExecutorConfigError,
    ExecutorError,
    HookArgumentError,
    HookOrderError,
    HookTypeError,
    UnknownStageError,
)
from .kernel_cache import DEFAULT_KERNEL_CACHE_SIZE

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
    first_stage_input_grads: bool = True,
    recompute: bool = False,
    token_loss: bool = False,
    kernel_cache_size: int = DEFAULT_KERNEL_CACHE_SIZE,
    dynamic_shapes: bool = False,
    jit_options: Mapping[str, Any] | None = None,
    split_backward: bool = False,
) -> Executor:
    """The executor for one rank.

    ``stages`` maps virtual stage index to the chunk this rank runs; ``preprocess`` is the
    replicated preprocess block; ``loss_fn(output, *labels)`` makes the loss on the last stage
    (``None``: the last chunk returns the scalar loss itself, called as
    ``chunk(*inputs, *labels)``); ``last_stage`` is the index of the model's last stage
    (default: the highest index in ``stages``); gradients are those of ``loss_scale * loss``.
    ``first_stage_input_grads=False`` skips the gradient of stage 0's inputs (they are raw
    data, or the output of a frozen preprocess: nobody reads it), saving that work in every
    stage-0 backward. ``recompute=True`` keeps only a stage's inputs between its forward and
    its backward, which records the forward again (less memory per in-flight micro-batch, about
    one more forward of time); the default keeps what MindSpore's tape records and recomputes
    nothing. A ``recompute`` that is not a bool is refused. ``token_loss=True``: the loss is a
    ``(sum_of_token_losses, token_count)`` pair and only the sum is differentiated (the caller
    divides by the global token count). ``loss_scale`` can be changed later without a
    recompilation (:meth:`Executor.set_loss_scale`). ``kernel_cache_size``: how many made
    kernels the executor keeps (least recently used evicted first, counted in
    :attr:`Executor.compile_stats`). ``dynamic_shapes=True``: one kernel per tensor rank and dtype
    whatever the sizes (graph mode: a static graph for the first shape and one dynamic-shape
    graph for every other, :mod:`~graph_exec.executors.dynamic_kernel`, ``docs/shapes.md``).
    ``jit_options``: what every ``mindspore.jit`` of the graph executor is given
    (:mod:`~graph_exec.executors.jit_options`; checked in both modes, unused in pynative).
    ``split_backward=True`` (the schedule's ``body="zb"``): every forward is recorded for the
    split backward from the first on, so ``I`` holds the split layers' inputs and output
    gradients, not a whole copy of the weight gradients (:mod:`~graph_exec.executors.split_backward`).

    Shape bucketing is not done here but on the batch, by the schedules (``shapes="buckets"``,
    :mod:`graph_exec.runtime.shapes`): the executor compiles whatever shapes it is given.
    """
    checks.boolean("recompute", recompute, ExecutorConfigError)
    if mode not in MODES:
        raise ExecutorConfigError(f"unknown executor mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "graph":
        from .graph import GraphExecutor as chosen
    else:
        from .pynative import PynativeExecutor as chosen
    return chosen(
        stages,
        preprocess=preprocess,
        loss_fn=loss_fn,
        last_stage=last_stage,
        loss_scale=loss_scale,
        first_stage_input_grads=first_stage_input_grads,
        recompute=recompute,
        token_loss=token_loss,
        kernel_cache_size=kernel_cache_size,
        dynamic_shapes=dynamic_shapes,
        jit_options=jit_options,
        split_backward=split_backward,
    )


__all__ = [
    "DEFAULT_KERNEL_CACHE_SIZE",
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
