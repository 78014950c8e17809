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
- ``host_*``: the same arithmetic on the accumulators' host memory, for the CPU fast path
  (:attr:`graph_exec.device.DevicePolicy.host_gradient_math`), where every op of a compiled
  kernel pays MindSpore's launch cost. Scaling, the check, the share and zeroing run in C++ by
  address (``graph_exec._hostmath``), one call per dtype over every accumulator: an
  ``asnumpy()`` view costs about 13 us a tensor here against well under one for
  ``data_ptr()``, and the C++ pass fuses what numpy does in three (on the 38 accumulators of
  a rank of ``embed_lm`` small: 1.04 ms for the numpy unscale-check-share, 0.72 ms for a numpy
  scale). Setting aside and adding back (only for gradients accumulated over several
  ``run()`` calls) go through numpy views. All wait for every queued op first, as the host
  gradient adds do, and take float32 and float64 accumulators (:data:`HOST_DTYPES`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, ops

from graph_exec import _hostmath
from graph_exec.device import wait_until_run

#: Accumulator dtypes the host arithmetic (C++ by address) handles; an executor with any other
#: keeps the compiled kernels.
HOST_DTYPES = (ms.float32, ms.float64)
_SCALE_AND_MEASURE = {
    ms.float32: _hostmath.scale_and_measure_float32,
    ms.float64: _hostmath.scale_and_measure_float64,
}
_ZERO = {ms.float32: _hostmath.zero_float32, ms.float64: _hostmath.zero_float64}

#: Parameter dtypes whose gradients accumulate in float32: summing many low-precision
#: micro-batch gradients in their own dtype would lose most of their bits.
LOW_PRECISION = (ms.float16, ms.bfloat16)


def accumulator_dtype(dtype: ms.dtype) -> ms.dtype:
    """The dtype of the accumulator of a parameter of ``dtype``: float32 for float16 and
    bfloat16, the parameter's own otherwise."""
    return ms.float32 if dtype in LOW_PRECISION else dtype


def make_multiply_grads(buffers: ParameterTuple) -> Callable[[Tensor], None]:
    """``multiply_grads(factor)``: every accumulator multiplied in place by the scalar ``factor``."""

    def multiply_grads(factor: Tensor) -> None:
        for index in range(len(buffers)):
            ops.assign(buffers[index], buffers[index] * factor.astype(buffers[index].dtype))

    return multiply_grads


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


class HostGradients:
    """The end-of-step arithmetic of :func:`make_multiply_grads`, :func:`make_norm_part`,
    :func:`make_unscale_and_check`, :func:`make_set_aside`/:func:`make_add_back` and
    :func:`~kernels.grad_buffers.make_zero_grads`, on the host memory of ``buffers`` (the CPU
    fast path; float32 and float64 only, :data:`HOST_DTYPES`).

    Every call first waits for MindSpore's queued ops, then takes each tensor's ``data_ptr()``
    (its host memory on CPU; read each call, not kept). The dtype groups and sizes are worked out
    once here: reading ``dtype`` and ``size`` of every tensor cost as much as the C++ pass.
    ``counted`` arguments are positions in ``buffers``.
    """

    def __init__(self, buffers: Sequence[Tensor]) -> None:
        unknown = sorted({str(b.dtype) for b in buffers if b.dtype not in HOST_DTYPES})
        if unknown:
            raise TypeError(f"host gradient arithmetic takes {HOST_DTYPES} accumulators, got {unknown}")
        self.buffers = tuple(buffers)
        groups: dict[ms.dtype, list[int]] = {}
        for index, buffer in enumerate(self.buffers):
            if buffer.size:  # an empty tensor adds nothing and may have no address
                groups.setdefault(buffer.dtype, []).append(index)
        self._groups = [
            (dtype, members, [self.buffers[i] for i in members], [self.buffers[i].size for i in members])
            for dtype, members in groups.items()
        ]
        self._flags: dict[tuple[int, ...], list[list[bool]]] = {}
        self._kept: list[np.ndarray] | None = None

    def _addresses(self, tensors: Sequence[Tensor]) -> list[int]:
        return [tensor.data_ptr() for tensor in tensors]

    def _counted_flags(self, counted: Collection[int]) -> list[list[bool]]:
        key = tuple(counted)
        flags = self._flags.get(key)
        if flags is None:
            chosen = set(key)
            flags = self._flags[key] = [[i in chosen for i in members] for _, members, _, _ in self._groups]
        return flags

    def _scale_and_measure(
        self, factor: float, counted: Collection[int], norm_type: float
    ) -> tuple[bool, float]:
        """Every buffer multiplied in place by ``factor`` (rounded to its dtype; 1 writes
        nothing); ``(every value finite, the norm_type share of buffers[counted])`` of the
        results: a sum of ``|g| ** p`` or the largest ``|g|``, NaN when a counted value is NaN
        (as numpy's)."""
        wait_until_run()
        results = [
            _SCALE_AND_MEASURE[dtype](self._addresses(tensors), sizes, factor, flags, norm_type)
            for (dtype, _, tensors, sizes), flags in zip(
                self._groups, self._counted_flags(counted), strict=True
            )
        ]
        finite = all(ok for ok, _ in results)
        shares = [share for _, share in results]
        if math.isinf(norm_type):  # the largest of the dtypes' largest (NaN wins, as in numpy)
            return finite, (math.nan if any(math.isnan(v) for v in shares) else max(shares, default=0.0))
        return finite, sum(shares)

    def norm_part(self, counted: Collection[int], norm_type: float) -> float:
        """:func:`make_norm_part`'s share of ``buffers[counted]`` (reduced in float64)."""
        return self._scale_and_measure(1.0, counted, norm_type)[1]

    def unscale_and_check(
        self, factor: float, counted: Collection[int], norm_type: float | None
    ) -> tuple[bool, float]:
        """:func:`make_unscale_and_check`: ``(every value finite, norm share)`` after multiplying
        every accumulator in place by ``factor``, in one pass."""
        if norm_type is None:
            return self._scale_and_measure(factor, (), 2.0)[0], 0.0
        return self._scale_and_measure(factor, counted, norm_type)

    def multiply(self, factor: float) -> None:
        """Every accumulator multiplied in place by ``factor`` (rounded to its dtype first)."""
        self._scale_and_measure(factor, (), 2.0)

    def zero(self) -> None:
        """Every accumulator set to +0.0."""
        wait_until_run()
        for dtype, _, tensors, sizes in self._groups:
            _ZERO[dtype](self._addresses(tensors), sizes)

    def set_aside(self) -> None:
        """Keep a copy of every accumulator and zero them (:func:`make_set_aside`), through
        numpy views: only gradients accumulated over several ``run()`` calls come here."""
        wait_until_run()
        self._kept = []
        for buffer in self.buffers:
            view = buffer.asnumpy()
            self._kept.append(view.copy())
            view[...] = 0

    def add_back(self) -> None:
        """Add what :meth:`set_aside` kept to every accumulator, once."""
        if self._kept is None:
            return
        wait_until_run()
        for buffer, earlier in zip(self.buffers, self._kept, strict=True):
            view = buffer.asnumpy()
            np.add(view, earlier, out=view)
        self._kept = None
