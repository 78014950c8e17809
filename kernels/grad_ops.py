"""Kernels over the gradient accumulators as a whole: what the end of a training step does.

Unscaling a loss-scaled gradient, clipping by a global norm, measuring a norm and setting this
step's gradients apart from earlier ones are each one function over every accumulator, so the
graph executor compiles each into one graph (one dispatch instead of one per parameter) and the
pynative executor runs the same function eagerly. The accumulators are closed over, never
passed: a compiled function taking a tuple of tensors recompiles on every call (measured, see
:mod:`kernels.grad_buffers`); a factor travels as a scalar tensor argument, so a new value runs
the same graph. Like every kernel with only side effects, these return ``None`` (see
:mod:`kernels.grad_buffers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mindspore as ms
from mindspore import ParameterTuple, Tensor, ops

#: Parameter dtypes whose gradients accumulate in float32: summing many low-precision
#: micro-batch gradients in their own dtype would lose most of their bits.
LOW_PRECISION = (ms.float16, ms.bfloat16)


def accumulator_dtype(dtype: ms.dtype) -> ms.dtype:
    """The dtype of the accumulator of a parameter of ``dtype``: float32 for float16 and
    bfloat16, the parameter's own otherwise."""
    return ms.float32 if dtype in LOW_PRECISION else dtype


def make_scale_grads(buffers: ParameterTuple) -> Callable[[Tensor], None]:
    """``scale(factor)``: every accumulator multiplied in place by the scalar ``factor``."""

    def scale_grads(factor: Tensor) -> None:
        for index in range(len(buffers)):
            ops.assign(buffers[index], buffers[index] * factor.astype(buffers[index].dtype))

    return scale_grads


def make_norm_part(buffers: ParameterTuple, norm_type: float) -> Callable[[], Tensor]:
    """``part()``: this rank's share of a global ``norm_type``-norm over ``buffers`` (at least
    one), as a float32 scalar: the sum of ``|g| ** p`` (``p = 2``: of squares), or the largest
    ``|g|`` for ``p = inf``. Shares of disjoint sets combine by a sum (a max for ``inf``); the
    norm is the ``p``-th root of the sum."""
    if math.isinf(norm_type):

        def largest() -> Tensor:
            return ops.stack(
                [ops.abs(buffers[i].astype(ms.float32)).max() for i in range(len(buffers))]
            ).max()

        return largest
    if norm_type == 2.0:

        def squares() -> Tensor:
            return ops.stack(
                [ops.square(buffers[i].astype(ms.float32)).sum() for i in range(len(buffers))]
            ).sum()

        return squares

    def powers() -> Tensor:
        return ops.stack(
            [ops.pow(ops.abs(buffers[i].astype(ms.float32)), norm_type).sum() for i in range(len(buffers))]
        ).sum()

    return powers


def make_set_aside(buffers: ParameterTuple, kept: ParameterTuple) -> Callable[[], None]:
    """``set_aside()``: copy every accumulator into ``kept`` and zero it, so that the next step's
    gradients can be post-processed (unscaled, normalised, summed across ranks) on their own."""

    def set_aside() -> None:
        for index in range(len(buffers)):
            ops.assign(kept[index], buffers[index])
            ops.assign(buffers[index], ops.zeros_like(buffers[index]))

    return set_aside


def make_add_back(buffers: ParameterTuple, kept: ParameterTuple) -> Callable[[], None]:
    """``add_back()``: add what :func:`make_set_aside` kept to every accumulator."""

    def add_back() -> None:
        for index in range(len(buffers)):
            ops.assign_add(buffers[index], kept[index])

    return add_back
