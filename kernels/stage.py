"""Kernels of a pipeline stage chunk: forward, recompute-and-backward, fused last-stage step.

Each ``make_*`` function closes over the user's cell and returns a plain function of tensors.
The graph executor compiles that function with ``mindspore.jit``; the pynative executor calls it
as is. Everything the function must know that is not a tensor (which inputs are float, which
outputs received a cotangent) is fixed when it is made, so one made function matches one
executor signature and compiles to one static graph.

The backward never receives saved activations: it recomputes the forward from the kept stage
inputs inside its own graph (a compiled graph cannot hand a live autograd tape back to Python),
which makes a stage's memory per in-flight micro-batch one set of inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, nn, ops

from .autodiff import as_tuple, grads_of
from .grad_buffers import GradBuffers, accumulate


@dataclass(frozen=True)
class BackwardLayout:
    """The non-tensor facts a backward kernel is built for.

    ``grad_inputs``: positions of the inputs that get a gradient (the float ones).
    ``cotangent_outputs``: positions of the outputs that received a cotangent, in the order the
    cotangents follow the inputs in the kernel's arguments; missing ones count as zeros.
    """

    num_inputs: int
    grad_inputs: tuple[int, ...]
    cotangent_outputs: tuple[int, ...]


def make_stage_forward(cell: nn.Cell) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs) -> outputs`` (always a tuple)."""

    def stage_forward(*inputs: Tensor) -> tuple[Tensor, ...]:
        return as_tuple(cell(*inputs))

    return stage_forward


def make_stage_backward(
    cell: nn.Cell, grads: GradBuffers, layout: BackwardLayout
) -> Callable[..., tuple[Tensor, ...] | None]:
    """``backward(*inputs, *cotangents) -> input grads`` (one per ``layout.grad_inputs``).

    With no float input it returns ``None`` instead of an empty tuple (see ``grad_buffers``).

    Differentiates ``sum_i <output_i, cotangent_i>`` over the outputs that have a cotangent:
    its gradient is exactly the vector-Jacobian product with zeros elsewhere, and a plain
    scalar objective keeps the cotangents ordinary inputs (a ``sens`` input would block
    dynamic shapes). Weight gradients go into ``grads`` inside the graph.
    """
    num_inputs = layout.num_inputs
    cotangent_outputs = layout.cotangent_outputs
    grad_inputs = layout.grad_inputs

    def objective(*args: Tensor) -> Tensor:
        outputs = as_tuple(cell(*args[:num_inputs]))
        total = 0.0
        for k, index in enumerate(cotangent_outputs):
            total = total + (outputs[index] * args[num_inputs + k]).sum()
        return total

    if not cotangent_outputs:
        # Every cotangent is zero: so are the gradients, and nothing needs recomputing.
        def zero_backward(*args: Tensor) -> tuple[Tensor, ...]:
            return tuple([ops.zeros_like(args[i]) for i in grad_inputs])

        return zero_backward

    differentiate = grads_of(objective, grad_inputs, grads.params)
    buffers = grads.buffers

    def stage_backward(*args: Tensor) -> tuple[Tensor, ...]:
        _, input_grads, weight_grads = differentiate(*args)
        accumulate(buffers, weight_grads)
        return input_grads

    def stage_backward_weights_only(*args: Tensor) -> None:
        _, _, weight_grads = differentiate(*args)
        accumulate(buffers, weight_grads)

    return stage_backward if grad_inputs else stage_backward_weights_only


def make_last_stage_step(
    cell: nn.Cell,
    grads: GradBuffers,
    num_inputs: int,
    grad_inputs: tuple[int, ...],
    loss_fn: Callable[..., Tensor] | None,
    loss_scale: float,
) -> Callable[..., tuple[Tensor, tuple[Tensor, ...]]]:
    """``step(*inputs, *labels) -> (loss, input grads)``: forward, loss and backward fused.

    The loss is ``loss_fn(output, *labels)``, or, without ``loss_fn``, the cell's own scalar
    output of ``cell(*inputs, *labels)``. Gradients are those of ``loss_scale * loss`` (the
    runtime passes ``1/M`` to average over M micro-batches); the returned loss is unscaled.
    """

    def loss_of(*args: Tensor) -> Tensor:
        if loss_fn is None:
            return cell(*args)
        return loss_fn(cell(*args[:num_inputs]), *args[num_inputs:])

    def objective(*args: Tensor) -> tuple[Tensor, Tensor]:
        loss = loss_of(*args)
        return loss * loss_scale, loss

    if not grad_inputs and not len(grads):
        # Nothing on this stage trains and no input needs a gradient: only the loss is wanted.
        def loss_only(*args: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
            return loss_of(*args), ()

        return loss_only

    differentiate = grads_of(objective, grad_inputs, grads.params, has_aux=True)
    buffers = grads.buffers

    def last_stage_step(*args: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        loss, input_grads, weight_grads = differentiate(*args)
        accumulate(buffers, weight_grads)
        return loss, input_grads

    return last_stage_step
