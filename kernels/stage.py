"""Kernels of a pipeline stage chunk: the forward, the loss of the last stage, the fused step.

Each ``make_*`` function closes over the user's cell and returns a plain function of tensors.
The graph executor compiles it with ``mindspore.jit``; the pynative executor calls it as is.
Neither the forward nor the loss kernel differentiates anything: the executors run them under
MindSpore's autograd tape, which records what the backward needs (see
``graph_exec.executors.tape``). Everything a function must know that is not a tensor is fixed
when it is made, so one made function matches one executor signature and compiles to one
static graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import Tensor, nn

from .autodiff import as_tuple, value_and_grads
from .grad_buffers import GradBuffers, make_accumulate


def make_stage_forward(cell: nn.Cell) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs) -> outputs`` (always a tuple)."""

    def stage_forward(*inputs: Tensor) -> tuple[Tensor, ...]:
        return as_tuple(cell(*inputs))

    return stage_forward


def make_stage_loss(
    cell: nn.Cell, num_inputs: int, loss_fn: Callable[..., Tensor] | None
) -> Callable[..., Tensor]:
    """``loss(*inputs, *labels)``: ``loss_fn(cell(*inputs), *labels)``, or, without ``loss_fn``,
    the cell's own scalar output of ``cell(*inputs, *labels)``."""

    def stage_loss(*args: Tensor) -> Tensor:
        if loss_fn is None:
            return cell(*args)
        return loss_fn(cell(*args[:num_inputs]), *args[num_inputs:])

    return stage_loss


def make_last_stage_step(
    cell: nn.Cell,
    grads: GradBuffers,
    num_inputs: int,
    grad_inputs: tuple[int, ...],
    loss_fn: Callable[..., Tensor] | None,
    loss_scale: float,
) -> Callable[..., tuple[Tensor, tuple[Tensor, ...]]]:
    """``step(*inputs, *labels) -> (loss, input grads)``: forward, loss and backward fused.

    Gradients are those of ``loss_scale * loss`` (the runtime passes ``1/M`` to average over M
    micro-batches), added into ``grads`` inside the graph; the returned loss is unscaled.
    """
    loss_of = make_stage_loss(cell, num_inputs, loss_fn)

    def objective(*args: Tensor) -> tuple[Tensor, Tensor]:
        loss = loss_of(*args)
        return loss * loss_scale, loss

    if not grad_inputs and not len(grads):
        # Nothing on this stage trains and no input needs a gradient: only the loss is wanted.
        def loss_only(*args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
            return loss_of(*args), ()

        return loss_only

    differentiate = value_and_grads(objective, grad_inputs, grads.params, has_aux=True)
    accumulate = make_accumulate(grads.buffers)

    def last_stage_step(*args: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        (_, loss), input_grads, weight_grads = differentiate(*args)
        accumulate(*weight_grads)
        return loss, input_grads

    return last_stage_step
