"""Per-parameter gradient accumulators and the graph-safe ways to touch them.

MindSpore has no ``param.grad``; gradients are values returned by the autograd tape's backward.
To sum them over micro-batches, every trainable parameter gets one accumulator ``Parameter`` (named ``gacc.<param name>``: graphs need unique names, and optimizer
state such as momentum already uses other prefixes) that the executors update with eager
``ops.assign_add`` (measured fastest; see ``graph_exec.executors.kernel_executor``). ``Tensor.add_`` is not in place on CPU, so the accumulators must only ever
change through the functions here.

A kernel whose only effect is on accumulators returns ``None``: under ``mindspore.jit`` in
MindSpore 2.10 a function that returns an empty tuple silently loses its side effects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mindspore import Parameter, ParameterTuple, Tensor, ops

#: Prefix of every accumulator name.
BUFFER_PREFIX = "gacc."


def make_buffer(param: Parameter) -> Parameter:
    """A zero accumulator shaped like ``param``; it never trains itself."""
    return Parameter(ops.zeros_like(param), name=BUFFER_PREFIX + param.name, requires_grad=False)


class GradBuffers:
    """The trainable parameters of one cell, paired with their accumulators.

    A kernel differentiates with respect to ``params`` and adds each gradient into the
    accumulator at the same position of ``buffers``. Two cells that share a ``Parameter``
    object share its accumulator, so tied weights collect the gradient of both uses.
    """

    def __init__(self, params: Sequence[Parameter], buffers: Sequence[Parameter]) -> None:
        if len(params) != len(buffers):
            raise ValueError(f"{len(params)} parameters but {len(buffers)} gradient buffers")
        self.params = ParameterTuple(params)
        self.buffers = ParameterTuple(buffers)

    def __len__(self) -> int:
        return len(self.params)


def make_accumulate(buffers: ParameterTuple) -> Callable[..., None]:
    """``add(*grads)``: ``buffers[i] += grads[i]`` in place, for every ``i``.

    Runs eagerly or under ``mindspore.jit``. The gradients come flat (one positional tensor
    each): a compiled function taking a tuple of tensors was measured to recompile on every
    call; the buffers are closed over, not passed.
    """

    def accumulate(*grads: Tensor) -> None:
        for index in range(len(buffers)):
            ops.assign_add(buffers[index], grads[index])

    return accumulate


def make_zero_grads(buffers: ParameterTuple) -> Callable[[], None]:
    """A kernel that resets every accumulator to zero (``zero_``/``fill_`` have no CPU kernel)."""

    def zero_grads() -> None:
        for index in range(len(buffers)):
            ops.assign(buffers[index], ops.zeros_like(buffers[index]))

    return zero_grads
