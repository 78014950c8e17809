"""The executor's gradient accumulators: built once per executor, added into per backward, and
worked on as a whole at the end of a step.

Weight gradients come back from the tape as tensors and are added by ``GradBuffers.add``, in
both modes: on CPU by address in C++ (``graph_exec._hostmath``, float32 and float64
accumulators; a gradient that is not contiguous goes through numpy), elsewhere eager
``ops.assign_add``, one per parameter: the fastest exact candidate measured
(``docs/performance.md``, "Gradient accumulation candidates"). A float16 or bfloat16 gradient
is cast to its float32 accumulator first (exact). The
arithmetic on every accumulator at once is :mod:`~graph_exec.executors.whole_grads`'s, chosen
once here; an executor with no trainable parameter does none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from graph_exec.kernels import GradBuffers, make_buffer

from .errors import ExecutorConfigError
from .whole_grads import CallKernel, Prepare, whole_gradients


class GradAccumulators:
    """One :class:`GradBuffers` per owner (``"stage k"``, ``"preprocess"``) over one accumulator
    per trainable parameter; ``buffers``: the accumulators by parameter name (live, no copies).

    ``host_math``: the device policy's ``host_gradient_math`` (the whole-gradient arithmetic on
    host memory where the accumulators allow it); ``call`` and ``prepare``: the executor's
    kernel cache and kernel preparation, for the compiled alternative."""

    def __init__(
        self, owners: list[tuple[str, nn.Cell]], host_math: bool, call: CallKernel, prepare: Prepare
    ) -> None:
        self.buffers: dict[str, Parameter] = {}
        #: The :class:`GradBuffers` of each owner, by owner.
        self.by_owner = build_grad_buffers(owners, self.buffers)
        self._index = {name: i for i, name in enumerate(self.buffers)}
        # Low-precision gradients are cast to their float32 accumulators before the adds.
        self._casts = {
            id(g): tuple(
                b.dtype if b.dtype != p.dtype else None for p, b in zip(g.params, g.buffers, strict=True)
            )
            for g in self.by_owner.values()
        }
        self._whole = whole_gradients(
            host_math, ParameterTuple(list(self.buffers.values())), self.buffers, call, prepare
        )

    def accumulate(self, grads: GradBuffers, weight_grads: tuple) -> None:
        """Add ``weight_grads`` into the accumulators of ``grads`` (one of :attr:`by_owner`)."""
        if weight_grads:
            casts = self._casts[id(grads)]
            if any(casts):
                weight_grads = tuple(
                    g if dtype is None else ops.cast(g, dtype)
                    for g, dtype in zip(weight_grads, casts, strict=True)
                )
            grads.add(*weight_grads)

    def multiply(self, factor: Any) -> None:
        if self.buffers:
            self._whole.multiply(factor)

    def norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        names = tuple(name for name in names if self.buffers[name].size)  # an empty one adds nothing
        if not names:
            return ops.zeros((), ms.float32)
        return self._whole.norm_part(names, norm_type)

    def unscale_and_check(
        self, factor: float, names: Sequence[str], norm_type: float | None
    ) -> tuple[bool, float]:
        if not self.buffers:
            return True, 0.0
        counted = tuple(self._index[name] for name in names if self.buffers[name].size)
        return self._whole.unscale_and_check(factor, counted, norm_type)

    def set_aside(self) -> None:
        if self.buffers:
            self._whole.set_aside()

    def add_back(self) -> None:
        if self.buffers:
            self._whole.add_back()

    def zero(self) -> None:
        if self.buffers:
            self._whole.zero()


def build_grad_buffers(
    owners: list[tuple[str, nn.Cell]], buffers: dict[str, Parameter]
) -> dict[str, GradBuffers]:
    """One :class:`GradBuffers` per owner, filling ``buffers`` (name -> accumulator).

    Trainable parameters are matched by identity: one ``Parameter`` used by two cells shares
    one accumulator, while two different parameters with one name are refused — MindSpore
    needs unique names in a graph, and gradients are reported by name.
    """
    by_name: dict[str, tuple[Parameter, str]] = {}
    result = {}
    for owner, cell in owners:
        params = cell.trainable_params()
        for param in params:
            seen = by_name.get(param.name)
            if seen is None:
                by_name[param.name] = (param, owner)
                buffers[param.name] = make_buffer(param)
            elif seen[0] is not param:
                raise ExecutorConfigError(
                    f"duplicate trainable parameter name {param.name!r}: in {seen[1]} and in {owner}; "
                    "give every chunk a distinct prefix (Cell.update_parameters_name)"
                )
        result[owner] = GradBuffers(params, [buffers[p.name] for p in params])
    return result
