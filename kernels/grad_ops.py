"""Kernels over the gradient accumulators as a whole: what the end of a training step does.

Unscaling a loss-scaled gradient, clipping by a global norm, measuring a norm, checking for an
overflow and setting this step's gradients apart from earlier ones are each one function over
every accumulator (unscaling, the check and the norm's share also together, as one pass).
Two forms:

- ``make_*``: MindSpore ops, compiled into one graph by the graph executor (one dispatch
  instead of one per parameter) and run eagerly by the pynative executor. The accumulators are
  closed over, never passed: a compiled function taking a tuple of tensors recompiles on every
  call (measured, see :mod:`kernels.grad_buffers`); a factor travels as a scalar tensor
  argument, so a new value runs the same graph. Like every kernel with only side effects, these
  return ``None`` (see :mod:`kernels.grad_buffers`).
- ``host_*``: the same arithmetic in numpy on the accumulators' host memory, for the CPU fast
  path (:attr:`graph_exec.device.DevicePolicy.host_gradient_math`), where every op of a
  compiled kernel pays MindSpore's launch cost. They read and write through ``asnumpy()``
  views after waiting for every queued op, as the host gradient adds do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, ops

from graph_exec.device import wait_until_run

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


def _norm_share(values: Sequence[Tensor], norm_type: float) -> Tensor:
    """The sum of ``|g| ** p`` over ``values`` (at least one), or the largest ``|g|`` for
    ``p = inf``, reduced in float32 (see :func:`make_norm_part`)."""
    if math.isinf(norm_type):
        return ops.stack([ops.abs(v.astype(ms.float32)).max() for v in values]).max()
    if norm_type == 2.0:
        return ops.stack([ops.square(v.astype(ms.float32)).sum() for v in values]).sum()
    return ops.stack([ops.pow(ops.abs(v.astype(ms.float32)), norm_type).sum() for v in values]).sum()


def make_norm_part(buffers: ParameterTuple, norm_type: float) -> Callable[[], Tensor]:
    """``part()``: this rank's share of a global ``norm_type``-norm over ``buffers`` (at least
    one), as a float32 scalar: the sum of ``|g| ** p`` (``p = 2``: of squares), or the largest
    ``|g|`` for ``p = inf``. Shares of disjoint sets combine by a sum (a max for ``inf``); the
    norm is the ``p``-th root of the sum."""

    def part() -> Tensor:
        return _norm_share([buffers[i] for i in range(len(buffers))], norm_type)

    return part


def make_unscale_and_check(
    buffers: ParameterTuple, counted: Sequence[int], norm_type: float | None
) -> Callable[[Tensor], Tensor]:
    """``check(factor)``: every accumulator multiplied in place by ``factor``, then, of the
    results, ``[1 if every value is finite else 0, the norm share of buffers[counted]]`` as a
    float32 pair (share 0 without ``norm_type`` or ``counted``).

    What the end of a loss-scaled step does to every gradient, in one graph rather than three
    (unscale, ``all_finite``, the norm's share): the finite check and the share read the
    products, not the accumulators written in the same graph."""
    counted = tuple(counted)

    def check(factor: Tensor) -> Tensor:
        scaled = []
        for index in range(len(buffers)):
            value = buffers[index] * factor.astype(buffers[index].dtype)
            ops.assign(buffers[index], value)
            scaled.append(value)
        finite = ops.stack([ops.isfinite(value).all() for value in scaled]).all()
        if norm_type is None or not counted:
            share = ops.zeros((), ms.float32)
        else:
            share = _norm_share([scaled[i] for i in counted], norm_type)
        return ops.stack([finite.astype(ms.float32), share])

    return check


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


def _host_views(buffers: Sequence[Tensor]) -> list[np.ndarray]:
    """Writable numpy views of ``buffers``' host memory, once every queued op has run."""
    wait_until_run()
    return [buffer.asnumpy() for buffer in buffers]


def _host_share(views: Sequence[np.ndarray], norm_type: float) -> float:
    """:func:`_norm_share` in numpy: each tensor reduced in its own dtype, the tensors summed in
    float64 (0 for none)."""
    views = [view for view in views if view.size]
    if math.isinf(norm_type):
        return max((float(np.abs(view).max()) for view in views), default=0.0)
    if norm_type == 2.0:
        return sum(float(np.vdot(view, view)) for view in views)
    return sum(float((np.abs(view) ** norm_type).sum()) for view in views)


def host_norm_part(buffers: Sequence[Tensor], norm_type: float) -> float:
    """:func:`make_norm_part`'s share, in numpy (see :func:`_host_share`)."""
    return _host_share(_host_views(buffers), norm_type)


def host_unscale_and_check(
    buffers: Sequence[Tensor], factor: float, counted: Sequence[int], norm_type: float | None
) -> tuple[bool, float]:
    """:func:`make_unscale_and_check` in numpy: ``(every value finite, norm share)`` after
    multiplying every accumulator in place by ``factor`` (rounded to its dtype first)."""
    views = _host_views(buffers)
    for view in views:
        np.multiply(view, view.dtype.type(factor), out=view)
    finite = all(np.isfinite(view).all() for view in views)
    share = 0.0 if norm_type is None else _host_share([views[i] for i in counted], norm_type)
    return finite, share


def host_scale(buffers: Sequence[Tensor], factor: float) -> None:
    """Every accumulator multiplied in place by ``factor`` (rounded to its dtype first)."""
    for view in _host_views(buffers):
        np.multiply(view, view.dtype.type(factor), out=view)


def host_set_aside(buffers: Sequence[Tensor]) -> list[np.ndarray]:
    """A copy of every accumulator, which is then zeroed (see :func:`make_set_aside`)."""
    kept = []
    for view in _host_views(buffers):
        kept.append(view.copy())
        view[...] = 0
    return kept


def host_add_back(buffers: Sequence[Tensor], kept: Sequence[np.ndarray]) -> None:
    """Add what :func:`host_set_aside` kept to every accumulator."""
    for view, earlier in zip(_host_views(buffers), kept, strict=True):
        np.add(view, earlier, out=view)
