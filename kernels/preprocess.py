"""Kernels of the replicated preprocess block (an embedding, a frozen vision tower).

In MPipe Transpose a rank runs the preprocess forward for micro-batches it owns, ships the
result away and only later receives that result's gradient. Nothing of the forward is kept:
the forward returns detached outputs, and the backward recomputes the forward from the same
inputs and accumulates the preprocess parameter gradients for the received cotangents.

The preprocess is called as ``cell(*inputs, **kwargs)``. Tensor keyword arguments are passed to
the kernel as keyword arguments; every other keyword value is a constant fixed when the kernel
is made (it becomes part of the compiled graph, and of the executor's signature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mindspore import Tensor, nn, ops

from .autodiff import as_tuple, grads_of
from .grad_buffers import GradBuffers, accumulate


def make_preprocess_forward(cell: nn.Cell, constants: Mapping[str, Any]) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs, **tensor_kwargs) -> outputs``, each cut from any autodiff graph."""
    constants = dict(constants)

    def preprocess_forward(*inputs: Tensor, **kwargs: Tensor) -> tuple[Tensor, ...]:
        outputs = as_tuple(cell(*inputs, **kwargs, **constants))
        return tuple([ops.stop_gradient(output) for output in outputs])

    return preprocess_forward


def make_preprocess_backward(
    cell: nn.Cell,
    grads: GradBuffers,
    constants: Mapping[str, Any],
    num_inputs: int,
    cotangent_outputs: tuple[int, ...],
) -> Callable[..., None]:
    """``backward(*inputs, *cotangents, **tensor_kwargs) -> None``: recompute and accumulate.

    Only the outputs listed in ``cotangent_outputs`` contribute (the others count as zero
    cotangents; with none at all there is nothing to do, and the caller must not build one).
    Inputs never get gradients: nothing upstream of the preprocess trains.
    """
    if not len(grads):
        raise ValueError("the preprocess has no trainable parameters: there is no backward to build")
    if not cotangent_outputs:
        raise ValueError("no output has a cotangent: every gradient is zero, there is nothing to build")
    constants = dict(constants)

    def objective(*args: Tensor, **kwargs: Tensor) -> Tensor:
        outputs = as_tuple(cell(*args[:num_inputs], **kwargs, **constants))
        total = 0.0
        for k, index in enumerate(cotangent_outputs):
            total = total + (outputs[index] * args[num_inputs + k]).sum()
        return total

    differentiate = grads_of(objective, (), grads.params)
    buffers = grads.buffers

    def preprocess_backward(*args: Tensor, **kwargs: Tensor) -> None:
        _, _, weight_grads = differentiate(*args, **kwargs)
        accumulate(buffers, weight_grads)

    return preprocess_backward
