"""The hook logic both executors share: bookkeeping, validation, kernel selection.

Everything that decides *what* runs lives here and in ``graph_exec.kernels``: which kernel a
hook needs, its cache key, what the forward keeps, and every check on the caller's arguments.
A subclass only decides *how* a freshly made kernel is turned into something callable
(compiled with ``mindspore.jit``, or left as the eager Python function), which is why graph and
pynative give the same numbers.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Parameter, ParameterTuple, Tensor, nn

from graph_exec.kernels import (
    BackwardLayout,
    GradBuffers,
    is_float,
    make_buffer,
    make_last_stage_step,
    make_preprocess_backward,
    make_preprocess_forward,
    make_stage_backward,
    make_stage_forward,
    make_zero_grads,
)
from graph_exec.msenv import prepare_mindspore

from .base import Executor, MaybeTensors, Tensors
from .errors import ExecutorConfigError, HookArgumentError, HookOrderError, HookTypeError, UnknownStageError
from .signature import TensorSpec, kwargs_key, split_kwargs, tensor_specs


@dataclass(frozen=True)
class KeptForward:
    """What a stage forward leaves for its backward: the inputs, and the output specs used to
    check the cotangents the backward receives."""

    inputs: Tensors
    outputs: tuple[TensorSpec, ...]


class KernelExecutor(Executor):
    """Implements every hook over the shared kernels; subclasses choose how kernels run."""

    def __init__(
        self,
        stages: Mapping[int, nn.Cell],
        *,
        preprocess: nn.Cell | None = None,
        loss_fn: Callable[..., Tensor] | None = None,
        last_stage: int | None = None,
        loss_scale: float = 1.0,
        first_stage_input_grads: bool = True,
    ) -> None:
        prepare_mindspore()
        self._stages = dict(sorted(stages.items()))
        self._preprocess = preprocess
        self._loss_fn = loss_fn
        self._loss_scale = float(loss_scale)
        self._first_stage_input_grads = first_stage_input_grads
        self._last_stage = max(self._stages) if last_stage is None and self._stages else last_stage
        owners = [(f"stage {k}", cell) for k, cell in self._stages.items()]
        if preprocess is not None:
            owners.append(("preprocess", preprocess))
        self._buffers: dict[str, Parameter] = {}
        grads = _build_grad_buffers(owners, self._buffers)
        self._stage_grads = {k: grads[f"stage {k}"] for k in self._stages}
        self._preprocess_grads = grads.get("preprocess")
        self._all_buffers = ParameterTuple(list(self._buffers.values()))
        self._kernels: dict[Hashable, Callable[..., Any]] = {}
        self._kept: dict[tuple[int, int], KeptForward] = {}
        self._backward_done: set[tuple[int, int]] = set()
        self._preprocess_outputs: dict[Hashable, tuple[TensorSpec, ...]] = {}
        self._preprocess_kept: dict[Hashable, tuple[Tensors, dict[str, Any]]] = {}  # TEMPORARY (#10)

    # ------------------------------------------------------------------ how kernels run

    @abstractmethod
    def _prepare(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """Turn a freshly made kernel into the callable cached for its signature."""

    def _on_new_kernel(self, first_call_seconds: float) -> None:
        """Called once per cached signature, after its first (possibly compiling) call."""

    def _call(self, key: Hashable, make: Callable[[], Callable[..., Any]], *args: Any, **kwargs: Any) -> Any:
        """Run the kernel cached under ``key``, making and preparing it on first use."""
        kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel(*args, **kwargs)
        kernel = self._prepare(make())
        start = time.perf_counter()
        result = kernel(*args, **kwargs)
        self._on_new_kernel(time.perf_counter() - start)
        self._kernels[key] = kernel
        return result

    # ------------------------------------------------------------------ preprocess hooks

    def broadcast_tensors(self) -> list[Any]:
        return list(self._preprocess_grads.params) if self._preprocess_grads is not None else []

    def preprocess_forward(self, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        cell = self._require_preprocess("preprocess_forward")
        specs = tensor_specs(inputs, "preprocess inputs")
        tensors, constants = split_kwargs(kwargs)
        signature = (specs, kwargs_key(tensors, constants))
        outputs = self._call(
            ("preprocess_forward", signature),
            lambda: make_preprocess_forward(cell, constants),
            *inputs,
            **tensors,
        )
        self._preprocess_outputs[signature] = tensor_specs(outputs, "preprocess outputs")
        return tuple(outputs)

    def preprocess_backward(
        self, inputs: Tensors, kwargs: Mapping[str, Any], cotangents: MaybeTensors
    ) -> None:
        """Recompute the preprocess and accumulate its parameter gradients.

        The cotangents are checked against the output specs recorded by ``preprocess_forward``
        for the same input signature; a signature never seen runs the forward once to learn
        them. A frozen preprocess returns at once.
        """
        cell = self._require_preprocess("preprocess_backward")
        grads = self._preprocess_grads
        if grads is None or not len(grads):
            return  # frozen preprocess: no gradient work at all, not even a compile
        specs = tensor_specs(inputs, "preprocess inputs")
        tensors, constants = split_kwargs(kwargs)
        signature = (specs, kwargs_key(tensors, constants))
        if signature not in self._preprocess_outputs:
            self.preprocess_forward(inputs, kwargs)  # learns the output specs to check against
        present = _check_cotangents("preprocess", self._preprocess_outputs[signature], cotangents)
        if not present:
            return
        self._call(
            ("preprocess_backward", signature, present),
            lambda: make_preprocess_backward(cell, grads, constants, len(inputs), present),
            *inputs,
            *[cotangents[i] for i in present],
            **tensors,
        )

    # --- TEMPORARY (issue #10, fair baseline): keep the inputs, recompute at the backward -----
    # Stand-in for issue #9's taped version (same hooks, same results); replaced at merge.

    def preprocess_forward_taped(self, key: Hashable, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        if key in self._preprocess_kept:
            raise HookOrderError(
                f"preprocess_forward_taped({key!r}): a forward is already kept under this key"
            )
        outputs = self.preprocess_forward(inputs, kwargs)
        self._preprocess_kept[key] = (tuple(inputs), dict(kwargs))
        return outputs

    def preprocess_backward_taped(self, key: Hashable, cotangents: MaybeTensors) -> None:
        kept = self._preprocess_kept.pop(key, None)
        if kept is None:
            raise HookOrderError(f"preprocess_backward_taped({key!r}) has no kept forward")
        self.preprocess_backward(*kept, cotangents)

    # --- end TEMPORARY -------------------------------------------------------------------------

    # ------------------------------------------------------------------ stage hooks

    def stage_forward(self, stage: int, micro: int, inputs: Tensors) -> Tensors:
        cell = self._stage(stage)
        key = (stage, micro)
        if key in self._kept:
            raise HookOrderError(
                f"stage_forward(stage {stage}, micro {micro}): a forward is already kept for this "
                "micro-batch and its backward has not run"
            )
        specs = tensor_specs(inputs, f"stage {stage}, micro {micro} inputs")
        outputs = self._call(("stage_forward", stage, specs), lambda: make_stage_forward(cell), *inputs)
        outputs = tuple(outputs)
        self._kept[key] = KeptForward(tuple(inputs), tensor_specs(outputs, f"stage {stage} outputs"))
        self._backward_done.discard(key)
        return outputs

    def stage_backward(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        cell = self._stage(stage)
        key = (stage, micro)
        kept = self._kept.get(key)
        if kept is None:
            why = "was already called for its forward" if key in self._backward_done else "has no forward"
            raise HookOrderError(f"stage_backward(stage {stage}, micro {micro}) {why}")
        present = _check_cotangents(f"stage {stage}, micro {micro}", kept.outputs, cotangents)
        grads = self._stage_grads[stage]
        grad_inputs = self._grad_inputs(stage, kept.inputs)
        result: list[Tensor | None] = [None] * len(kept.inputs)
        if grad_inputs or (present and len(grads)):
            layout = BackwardLayout(len(kept.inputs), grad_inputs, present)
            input_specs = tuple(TensorSpec.of(t) for t in kept.inputs)
            input_grads = self._call(
                ("stage_backward", stage, input_specs, present),
                lambda: make_stage_backward(cell, grads, layout),
                *kept.inputs,
                *[cotangents[i] for i in present],
            )
            for position, grad in zip(grad_inputs, input_grads or (), strict=True):
                result[position] = grad
        del self._kept[key]
        self._backward_done.add(key)
        return tuple(result)

    def last_stage_step(
        self, stage: int, micro: int, inputs: Tensors, labels: Tensors
    ) -> tuple[Any, MaybeTensors]:
        cell = self._stage(stage)
        if stage != self._last_stage:
            raise HookArgumentError(
                f"last_stage_step(stage {stage}, micro {micro}): the last stage is {self._last_stage}"
            )
        where = f"stage {stage}, micro {micro}"
        specs = tensor_specs(inputs, f"{where} inputs")
        label_specs = tensor_specs(labels, f"{where} labels")
        grads = self._stage_grads[stage]
        grad_inputs = self._grad_inputs(stage, inputs)
        loss, input_grads = self._call(
            ("last_stage_step", stage, specs, label_specs),
            lambda: make_last_stage_step(
                cell, grads, len(inputs), grad_inputs, self._loss_fn, self._loss_scale
            ),
            *inputs,
            *labels,
        )
        if tuple(loss.shape) != ():
            raise HookArgumentError(
                f"last_stage_step({where}): the loss must be a scalar, got shape {list(loss.shape)}"
            )
        result: list[Tensor | None] = [None] * len(inputs)
        for position, grad in zip(grad_inputs, input_grads, strict=True):
            result[position] = grad
        return loss, tuple(result)

    # ------------------------------------------------------------------ gradients and state

    def grads(self) -> dict[str, Any]:
        """The live accumulators (no copies), keyed by the name of the parameter they belong to."""
        return {name: buffer for name, buffer in self._buffers.items()}

    def zero_grad(self) -> None:
        if self._buffers:
            self._call(("zero_grad",), lambda: make_zero_grads(self._all_buffers))

    def kept(self) -> Sequence[Hashable]:
        return [*self._kept, *self._preprocess_kept]

    def drop_kept(self) -> None:
        self._kept.clear()
        self._preprocess_kept.clear()
        self._backward_done.clear()

    # ------------------------------------------------------------------ helpers

    def _grad_inputs(self, stage: int, inputs: Tensors) -> tuple[int, ...]:
        """Positions of the inputs whose gradient is wanted: the float ones, none of stage 0's
        when nobody reads them."""
        if stage == 0 and not self._first_stage_input_grads:
            return ()
        return tuple(i for i, tensor in enumerate(inputs) if is_float(tensor))

    def _stage(self, stage: int) -> nn.Cell:
        cell = self._stages.get(stage)
        if cell is None:
            raise UnknownStageError(f"stage {stage} is not on this rank (stages here: {list(self._stages)})")
        return cell

    def _require_preprocess(self, hook: str) -> nn.Cell:
        if self._preprocess is None:
            raise HookOrderError(f"{hook}: this executor was created without a preprocess cell")
        return self._preprocess


def _build_grad_buffers(
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


def _check_cotangents(
    where: str, outputs: tuple[TensorSpec, ...], cotangents: MaybeTensors
) -> tuple[int, ...]:
    """Check ``cotangents`` against the output specs; return the positions that are present."""
    if len(cotangents) != len(outputs):
        raise HookArgumentError(
            f"{where}: expected {len(outputs)} cotangent(s), one per output, got {len(cotangents)}"
        )
    present = []
    for index, (cotangent, spec) in enumerate(zip(cotangents, outputs, strict=True)):
        if cotangent is None:
            continue
        if not isinstance(cotangent, Tensor):
            raise HookTypeError(
                f"{where}: cotangent {index} must be a Tensor or None, got {type(cotangent).__name__}"
            )
        got = TensorSpec.of(cotangent)
        if got != spec:
            raise HookArgumentError(f"{where}: cotangent {index} is {got}, but output {index} is {spec}")
        if not is_float(cotangent):
            raise HookArgumentError(
                f"{where}: output {index} is {spec} and cannot take a gradient; pass None"
            )
        present.append(index)
    return tuple(present)
