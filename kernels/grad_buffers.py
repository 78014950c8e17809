"""Per-parameter gradient accumulators and the graph-safe ways to touch them.

MindSpore has no ``param.grad``; gradients are values returned by the autograd tape's backward.
To sum them over micro-batches, every trainable parameter gets one accumulator ``Parameter``
(named ``gacc.<param name>``: graphs need unique names, and optimizer state such as momentum
already uses other prefixes). ``GradBuffers.add`` updates them the fastest exact way measured
(see ``graph_exec.executors.kernel_executor``): on the CPU fast path host adds straight into their
memory (:func:`make_host_accumulate`; :attr:`graph_exec.device.DevicePolicy.host_accumulation`),
elsewhere eager ``ops.assign_add`` (:func:`make_accumulate`).
``Tensor.add_`` is not in place on CPU, so the accumulators must only ever change through the
functions here.

A kernel whose only effect is on accumulators returns ``None``: under ``mindspore.jit`` in
MindSpore 2.10 a function that returns an empty tuple silently loses its side effects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, ops

from graph_exec import _hostmath
from graph_exec.device import policy, wait_until_run

from .grad_ops import HOST_DTYPES, accumulator_dtype

#: Prefix of every accumulator name.
BUFFER_PREFIX = "gacc."
#: The C++ adder of each host-added dtype (:data:`~kernels.grad_ops.HOST_DTYPES`: their host
#: addition is the very IEEE addition MindSpore's CPU kernel does; numpy has no bfloat16, and
#: adds float16 through float32).
_ADD_BY_ADDRESS = {ms.float32: _hostmath.add_float32, ms.float64: _hostmath.add_float64}


def make_buffer(param: Parameter) -> Parameter:
    """A zero accumulator shaped like ``param``, float32 for a float16 or bfloat16 parameter
    (:func:`~kernels.grad_ops.accumulator_dtype`); it never trains itself."""
    zeros = ops.zeros(param.shape, accumulator_dtype(param.dtype))
    return Parameter(zeros, name=BUFFER_PREFIX + param.name, requires_grad=False)


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
        host = make_host_accumulate(self.buffers) if policy().host_accumulation else None
        #: ``add(*grads)``: ``buffers[i] += grads[i]`` in place, eagerly, the fastest exact way.
        self.add: Callable[..., None] = host or make_accumulate(self.buffers)

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


def make_host_accumulate(buffers: ParameterTuple) -> Callable[..., None] | None:
    """``add(*grads)`` on the host, straight into the accumulators' memory; only for MindSpore
    on CPU with its fast paths on, and ``None`` unless every accumulator is float32 or float64.

    On CPU a tensor's ``data_ptr()`` is its host memory, and writes there are seen by later
    eager ops and compiled graphs alike (measured with MindSpore 2.10). Waiting for the queued
    work first means no earlier op still reads or writes an accumulator. A gradient of the
    accumulator's dtype and shape, laid out contiguously (what a backward returns), is added
    by address in C++ (``graph_exec._hostmath``: about 1.5 us per parameter, against about 8 us
    through two ``asnumpy()`` views); any other goes through numpy. Eager only: it cannot run
    under ``mindspore.jit``.
    """
    if not all(buffer.dtype in HOST_DTYPES for buffer in buffers):
        return None
    plan = [
        (buffer, buffer.dtype, buffer.shape, buffer.size, _ADD_BY_ADDRESS[buffer.dtype]) for buffer in buffers
    ]

    def accumulate(*grads: Tensor) -> None:
        wait_until_run()
        for (buffer, dtype, shape, count, add), grad in zip(plan, grads, strict=True):
            if grad.dtype == dtype and grad.shape == shape and grad.is_contiguous():
                add(buffer.data_ptr(), grad.data_ptr(), count)
            else:
                view = buffer.asnumpy()
                np.add(view, grad.asnumpy(), out=view)

    return accumulate


def make_zero_grads(buffers: ParameterTuple) -> Callable[[], None]:
    """A kernel that resets every accumulator to zero (``zero_``/``fill_`` have no CPU kernel)."""

    def zero_grads() -> None:
        for index in range(len(buffers)):
            ops.assign(buffers[index], ops.zeros_like(buffers[index]))

    return zero_grads
