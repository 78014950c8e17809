"""The preprocess hooks: the cell that runs before stage 0 (embeddings, a vision tower), outside
the plan's stages.

Its backward is a recompute by default (its forward ran elsewhere, or long before): the
forward runs again under the tape and its gradient is taken in the same call. The taped hooks
(``preprocess_forward_taped`` / ``preprocess_backward_taped``) keep the forward per caller's key
instead, recorded unless ``recompute``. A mixin of :class:`~graph_exec.executors.kernel_executor.KernelExecutor`:
the kernel cache, the tape calls and the accumulators are the executor's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from mindspore import nn

from graph_exec.kernels import GradBuffers, make_preprocess_forward

from .base import MaybeTensors, Tensors
from .errors import HookOrderError
from .hook_checks import check_cotangents
from .kept import KeptForward, upstream_grads
from .signature import TensorSpec, kwargs_key, split_kwargs, tensor_specs
from .tape import Tape


class PreprocessHooks:
    """The preprocess hooks over the executor's kernel cache, tape calls and accumulators."""

    _preprocess: nn.Cell | None
    _preprocess_grads: GradBuffers | None
    _kept_preprocess: dict[Hashable, KeptForward]
    _preprocess_done: set[Hashable]
    _preprocess_outputs: dict[Hashable, tuple[TensorSpec, ...]]

    def broadcast_tensors(self) -> list[Any]:
        return list(self._preprocess_grads.params) if self._preprocess_grads is not None else []

    def preprocess_forward(self, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        signature, args, make = self._preprocess_kernel("preprocess_forward", inputs, kwargs)
        outputs = tuple(self._call(("preprocess_forward", signature), lambda: self._prepare(make()), *args))
        self._preprocess_outputs[signature] = tensor_specs(outputs, "preprocess outputs")
        return outputs

    def preprocess_backward(
        self, inputs: Tensors, kwargs: Mapping[str, Any], cotangents: MaybeTensors
    ) -> None:
        """Recompute the preprocess under the tape and accumulate its parameter gradients.

        The cotangents are checked against the output specs recorded by ``preprocess_forward``
        for the same input signature; a signature never seen runs the forward once to learn
        them. A frozen preprocess returns at once.
        """
        signature, args, make = self._preprocess_kernel("preprocess_backward", inputs, kwargs)
        grads = self._preprocess_grads
        if grads is None or not len(grads):
            return  # frozen preprocess: no gradient work at all, not even a compile
        if signature not in self._preprocess_outputs:
            self.preprocess_forward(inputs, kwargs)  # learns the output specs to check against
        specs = self._preprocess_outputs[signature]
        present = check_cotangents("preprocess", specs, cotangents)
        if not present:
            return
        tape = self._preprocess_tape(signature, make)
        kept = KeptForward(args, specs, tape, recorded=False)
        _, weight_grads = self._backward(
            ("preprocess_backward", signature), kept, upstream_grads(specs, cotangents)
        )
        self._accumulators.accumulate(grads, weight_grads)

    def preprocess_forward_taped(self, key: Hashable, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        where = f"preprocess_forward_taped(key {key!r})"
        signature, args, make = self._preprocess_kernel(where, inputs, kwargs)
        hash(key)
        if key in self._kept_preprocess:
            raise HookOrderError(
                f"{where}: a forward is already kept under this key and its backward has not run"
            )
        grads = self._preprocess_grads
        trains = grads is not None and len(grads) > 0
        if trains and not self.recompute:
            outputs, tape = self._taped(
                ("preprocess_tape", signature), lambda: self._preprocess_tape_for(make), *args
            )
            recorded = True
        else:
            outputs = self._call(("preprocess_forward", signature), lambda: self._prepare(make()), *args)
            tape = self._preprocess_tape(signature, make) if trains else None
            recorded = False
        outputs = tuple(outputs)
        specs = tensor_specs(outputs, "preprocess outputs")
        self._preprocess_outputs[signature] = specs
        self._kept_preprocess[key] = KeptForward(args, specs, tape, recorded)
        self._preprocess_done.discard(key)
        return outputs

    def preprocess_backward_taped(self, key: Hashable, cotangents: MaybeTensors) -> None:
        where = f"preprocess_backward_taped(key {key!r})"
        kept = self._kept_preprocess.get(key)
        if kept is None:
            why = "was already called for its forward" if key in self._preprocess_done else "has no forward"
            raise HookOrderError(f"{where} {why}")
        present = check_cotangents(where, kept.outputs, cotangents)
        if kept.tape is not None and (present or kept.recorded):
            # Without any cotangent the gradient is zero; a recorded forward is still consumed.
            sens = upstream_grads(kept.outputs, cotangents)
            _, weight_grads = self._backward(("preprocess_backward_taped", kept.outputs, present), kept, sens)
            if present:
                self._accumulators.accumulate(self._preprocess_grads, weight_grads)
        del self._kept_preprocess[key]
        self._preprocess_done.add(key)

    def _preprocess_kernel(
        self, where: str, inputs: Tensors, kwargs: Mapping[str, Any]
    ) -> tuple[Hashable, Tensors, Callable[[], Callable[..., Any]]]:
        """The signature, the kernel's positional arguments and a maker of the raw kernel."""
        cell = self._require_preprocess(where)
        specs = tensor_specs(inputs, "preprocess inputs")
        tensors, constants = split_kwargs(kwargs)
        signature = (specs, kwargs_key(tensors, constants))
        names = sorted(tensors)
        args = (*inputs, *(tensors[name] for name in names))
        return signature, args, lambda: make_preprocess_forward(cell, len(inputs), names, constants)

    def _preprocess_tape_for(self, make: Callable[[], Callable[..., Any]]) -> Tape:
        return Tape(
            make(),
            self._preprocess_grads.params,
            grad_inputs=False,
            prepare=self._prepare,
            dynamic_shapes=self.dynamic_shapes,
        )

    def _preprocess_tape(self, signature: Hashable, make: Callable[[], Callable[..., Any]]) -> Tape:
        """The (unrecorded) preprocess tape of ``signature``, cached like a kernel."""
        key = ("preprocess_tape", signature)
        return self._kernel(key, lambda: self._preprocess_tape_for(make))

    def _require_preprocess(self, hook: str) -> nn.Cell:
        if self._preprocess is None:
            raise HookOrderError(f"{hook}: this executor was created without a preprocess cell")
        return self._preprocess
