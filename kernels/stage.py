"""Kernels of a pipeline stage chunk: the forward, and the loss of the last stage.

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

from mindspore import Tensor, nn

from .autodiff import as_tuple


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
