"""The arithmetic on every gradient accumulator at once, done on the host or by compiled kernels.

An executor's end-of-step methods (:meth:`~graph_exec.executors.base.Executor.multiply_grads`,
``grad_norm_part``, ``unscale_and_check``, ``set_aside_grads``/``add_back_grads``,
``zero_grad``) act on all of its accumulators. Two implementations with one interface
(:class:`WholeGradients`), chosen once per executor by :func:`whole_gradients`:

- :class:`HostWholeGradients`: one C++ pass over the accumulators' host memory
  (:class:`~graph_exec.kernels.HostGradients`; the CPU fast path ``host_gradient_math``, float32
  and float64 accumulators);
- :class:`CompiledWholeGradients`: the kernels of :mod:`graph_exec.kernels.grad_ops`, made and
  cached by the executor like every other kernel (compiled in graph mode, eager in pynative),
  what a device runs.

Both are exact and give the same numbers (``tests/kernels/test_grad_ops.py``). Callers pass
only non-empty work: the executor returns early when it has no accumulator or nothing is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, ops

from graph_exec.kernels import (
    HOST_DTYPES,
    HostGradients,
    make_add_back,
    make_multiply_grads,
    make_norm_part,
    make_set_aside,
    make_unscale_and_check,
    make_zero_grads,
)

#: ``call(key, make, *args)``: run the kernel cached under ``key``, making it with ``make()``.
CallKernel = Callable[..., Any]
#: ``prepare(kernel)``: what runs a freshly made kernel (compiled or eager).
Prepare = Callable[[Callable[..., Any]], Callable[..., Any]]


class WholeGradients(Protocol):
    """What an executor does to all its accumulators (``counted``: positions in them)."""

    def multiply(self, factor: Any) -> None:
        """Every accumulator multiplied in place by ``factor`` (a float or a scalar tensor)."""

    def norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        """The ``norm_type`` share (sum of ``|g| ** p``, or the largest ``|g|``) of ``names``."""

    def unscale_and_check(
        self, factor: float, counted: tuple[int, ...], norm_type: float | None
    ) -> tuple[bool, float]:
        """Multiply everything by ``factor``; ``(all finite, norm share of counted)``."""

    def set_aside(self) -> None:
        """Keep a copy of every accumulator and zero them."""

    def add_back(self) -> None:
        """Add the copy :meth:`set_aside` kept back (nothing before a set-aside)."""

    def zero(self) -> None:
        """Every accumulator set to zero."""


def _as_float(factor: Any) -> float:
    return float(factor.asnumpy() if isinstance(factor, Tensor) else factor)


def scale_tensor(scale: Any) -> Tensor:
    """A loss scale or factor as the float32 scalar tensor the kernels take."""
    if isinstance(scale, Tensor):
        return scale.astype(ms.float32).reshape(())
    return Tensor(float(scale), ms.float32)


class HostWholeGradients:
    """:class:`WholeGradients` by one host pass (:class:`~graph_exec.kernels.HostGradients`)."""

    def __init__(self, buffers: ParameterTuple, index: Mapping[str, int]) -> None:
        self._host = HostGradients(buffers)
        self._index = index  # name -> position in buffers

    def multiply(self, factor: Any) -> None:
        self._host.multiply(_as_float(factor))

    def norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        counted = [self._index[name] for name in names]
        return Tensor(np.float64(self._host.norm_part(counted, norm_type)))  # the host's float64

    def unscale_and_check(
        self, factor: float, counted: tuple[int, ...], norm_type: float | None
    ) -> tuple[bool, float]:
        return self._host.unscale_and_check(factor, counted, norm_type)

    def set_aside(self) -> None:
        self._host.set_aside()

    def add_back(self) -> None:
        self._host.add_back()

    def zero(self) -> None:
        self._host.zero()


class CompiledWholeGradients:
    """:class:`WholeGradients` by the kernels of :mod:`graph_exec.kernels.grad_ops`, run
    through the executor's ``call`` (its kernel cache) and ``prepare`` (its way to run them)."""

    def __init__(
        self, buffers: ParameterTuple, by_name: Mapping[str, Parameter], call: CallKernel, prepare: Prepare
    ) -> None:
        self._buffers = buffers
        self._by_name = by_name
        self._call = call
        self._prepare = prepare
        self._kept: ParameterTuple | None = None  # made by the first set_aside()

    def _run(self, key: Hashable, make: Callable[[], Callable[..., Any]], *args: Any) -> Any:
        return self._call(key, lambda: self._prepare(make()), *args)

    def multiply(self, factor: Any) -> None:
        buffers = self._buffers
        self._run(("grad_scale",), lambda: make_multiply_grads(buffers), scale_tensor(factor))

    def norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        buffers = ParameterTuple([self._by_name[name] for name in names])
        return self._run(("grad_norm", tuple(names), norm_type), lambda: make_norm_part(buffers, norm_type))

    def unscale_and_check(
        self, factor: float, counted: tuple[int, ...], norm_type: float | None
    ) -> tuple[bool, float]:
        buffers = self._buffers
        pair = self._run(
            ("grad_unscale_check", counted, norm_type),
            lambda: make_unscale_and_check(buffers, counted, norm_type),
            scale_tensor(factor),
        ).asnumpy()  # read through the tensor
        return bool(pair[0] == 1.0), float(pair[1])

    def set_aside(self) -> None:
        if self._kept is None:
            self._kept = ParameterTuple(
                [
                    Parameter(ops.zeros_like(b), name=f"kept.{b.name}", requires_grad=False)
                    for b in self._buffers
                ]
            )
        buffers, kept = self._buffers, self._kept
        self._run(("grad_set_aside",), lambda: make_set_aside(buffers, kept))

    def add_back(self) -> None:
        if self._kept is not None:
            buffers, kept = self._buffers, self._kept
            self._run(("grad_add_back",), lambda: make_add_back(buffers, kept))

    def zero(self) -> None:
        buffers = self._buffers
        self._run(("zero_grad",), lambda: make_zero_grads(buffers))


def whole_gradients(
    host_math: bool,
    buffers: ParameterTuple,
    by_name: Mapping[str, Parameter],
    call: CallKernel,
    prepare: Prepare,
) -> WholeGradients:
    """The host implementation where ``host_math`` (the device policy's ``host_gradient_math``)
    allows it and every accumulator is float32 or float64, else the compiled one."""
    if host_math and all(b.dtype in HOST_DTYPES for b in buffers):
        return HostWholeGradients(buffers, {name: i for i, name in enumerate(by_name)})
    return CompiledWholeGradients(buffers, by_name, call, prepare)
