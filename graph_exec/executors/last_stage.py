"""The last stage's hooks: its loss, and in a training step the loss with its gradients.

:meth:`LastStageHooks.last_stage_step` takes the cheapest of three paths: the loss alone when
nothing is differentiated; the split backward when the weight gradients are held for ``W``
(``body="zb"``), whose linear layers' weight gradients are left to ``W``; else the loss and
every gradient in one call (:meth:`~graph_exec.executors.tape.Tape.value_and_gradient`, one
compiled graph in graph mode; measured in ``docs/performance.md``, "The last stage in one
graph"). A mixin of :class:`~graph_exec.executors.kernel_executor.KernelExecutor`: the kernel
cache, the split tapes, the held gradients and the accumulators are the executor's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, nn

from graph_exec.kernels import GradBuffers, make_stage_loss
from graph_exec.kernels.linear_split import probed

from .base import MaybeTensors, Tensors
from .errors import HookArgumentError, HookOrderError
from .hook_checks import check_loss, check_loss_count, loss_kind_error
from .signature import TensorSpec, tensor_specs
from .split_backward import LinearWork, SplitTape
from .tape import Tape
from .whole_grads import scale_tensor


def _run_loss_step(tape: Tape, args: Tensors, scale: Tensor) -> tuple[Any, tuple[tuple, tuple]]:
    return tape.value_and_gradient(args, scale)


def _run_split_loss_step(split: SplitTape, args: Tensors, scale: Tensor) -> tuple[Any, tuple[tuple, tuple]]:
    with probed(split.split):
        return split.tape.value_and_gradient(args, scale)


@dataclass(frozen=True)
class _LossCall:
    """One :meth:`KernelExecutor.last_stage_step`'s arguments as each of its paths needs them."""

    stage: int
    micro: int
    where: str  # "stage s, micro m", for messages
    inputs: Tensors
    args: Tensors  # the inputs, then the labels
    specs: tuple[TensorSpec, ...]
    label_specs: tuple[TensorSpec, ...]
    grad_inputs: tuple[int, ...]  # positions of the inputs whose gradient is returned

    @classmethod
    def of(
        cls,
        stage: int,
        micro: int,
        inputs: Tensors,
        labels: Tensors,
        grad_inputs: Callable[[int, Tensors], tuple[int, ...]],
    ) -> _LossCall:
        """Checked (the specs refuse what is not a tensor) before ``grad_inputs`` reads dtypes."""
        where = f"stage {stage}, micro {micro}"
        specs = tensor_specs(inputs, f"{where} inputs")
        label_specs = tensor_specs(labels, f"{where} labels")
        wanted = grad_inputs(stage, inputs)
        return cls(stage, micro, where, inputs, (*inputs, *labels), specs, label_specs, wanted)

    def input_grads(self, computed: Sequence[Any]) -> MaybeTensors:
        """One entry per input: the computed gradient at ``grad_inputs``, ``None`` elsewhere."""
        result: list[Tensor | None] = [None] * len(self.inputs)
        for position in self.grad_inputs:
            result[position] = computed[position]
        return tuple(result)


class LastStageHooks:
    """``last_stage_step``, ``last_stage_forward`` and ``set_loss_scale`` over the executor's state."""

    _last_stage: int | None
    _loss_fn: Callable[..., Tensor] | None
    _token_loss: bool
    _loss_scale: Tensor
    _stage_grads: dict[int, GradBuffers]
    _held: dict[tuple[int, int], tuple | LinearWork]

    def last_stage_step(
        self, stage: int, micro: int, inputs: Tensors, labels: Tensors, hold_weight_grads: bool = False
    ) -> tuple[Any, MaybeTensors]:
        """The loss and the input gradients, by the cheapest of three paths: no gradient at all,
        the split backward (weights held as ``W``'s work), or the whole loss step."""
        cell = self._stage(stage)
        self._check_last_stage_step(stage, micro, hold_weight_grads)
        call = _LossCall.of(stage, micro, inputs, labels, self._grad_inputs)
        if not call.grad_inputs and not len(self._stage_grads[stage]):
            return self._loss_only(cell, call, hold_weight_grads)
        if hold_weight_grads and not self.dynamic_shapes:
            split = self._loss_split_tape(cell, call)
            if split is not None:
                return self._split_loss_step(split, call)
        return self._whole_loss_step(cell, call, hold_weight_grads)

    def _check_last_stage_step(self, stage: int, micro: int, hold_weight_grads: bool) -> None:
        """Refuse a step whose weight gradients would overwrite held ones, or on another stage."""
        if hold_weight_grads and (stage, micro) in self._held:
            raise HookOrderError(
                f"last_stage_step(stage {stage}, micro {micro}): the weight gradients of an earlier "
                "step of this micro-batch are still held (stage_backward_weight has not run)"
            )
        if stage != self._last_stage:
            raise HookArgumentError(
                f"last_stage_step(stage {stage}, micro {micro}): the last stage is {self._last_stage}"
            )

    def _make_loss(self, cell: nn.Cell, call: _LossCall) -> Callable[..., Any]:
        return make_stage_loss(cell, len(call.inputs), self._loss_fn)

    def _loss_only(self, cell: nn.Cell, call: _LossCall, hold_weight_grads: bool) -> tuple[Any, MaybeTensors]:
        """Nothing to differentiate (a frozen last stage whose inputs take no gradient): the
        plain loss kernel, no tape; a held step holds no gradients, so ``W`` adds nothing."""
        loss = self._call(
            ("stage_loss", call.stage, call.specs, call.label_specs),
            lambda: self._prepare(self._make_loss(cell, call)),
            *call.args,
        )
        check_loss(call.where, loss, self._token_loss)
        if hold_weight_grads:
            self._held[(call.stage, call.micro)] = ()
        return loss, call.input_grads(())

    def _loss_split_tape(self, cell: nn.Cell, call: _LossCall) -> SplitTape | None:
        """The probed loss tape of ``call``'s signature, ``None`` when no layer can be split."""
        traced = call.args if self._loss_fn is None else call.inputs  # what the cell itself is called with
        key = ("loss_split_tape", call.stage, call.specs, call.label_specs, bool(call.grad_inputs))
        return self._split_tape(key, cell, traced, call.grad_inputs, lambda: self._make_loss(cell, call))

    def _loss_and_gradients(
        self, kind: str, run: Callable[..., Any], tape: Tape | SplitTape, call: _LossCall
    ) -> tuple[Any, tuple[tuple, tuple]]:
        """``run`` on ``tape`` (the loss and its gradients in one call, one compiled graph in
        graph mode), cached under ``kind`` and the step's signature; the loss scale is an input."""
        return self._call(
            (kind, call.stage, call.specs, call.label_specs), lambda: run, tape, call.args, self._loss_scale
        )

    def _split_loss_step(self, split: SplitTape, call: _LossCall) -> tuple[Any, MaybeTensors]:
        """The zb path: the loss and input gradients now, the linear layers' weight gradients
        left to ``W`` (held as :class:`LinearWork`), so the last stage's ``W`` can fill a bubble."""
        output, (input_grads, grads) = self._loss_and_gradients(
            "loss_split_step", _run_split_loss_step, split, call
        )
        count = split.saved_count
        head, saved = tuple(output[:-count]), tuple(output[-count:])
        check_loss_count(call.where, len(head), self._token_loss)
        loss = head if self._token_loss else head[0]
        check_loss(call.where, loss, self._token_loss)
        self._held[(call.stage, call.micro)] = LinearWork.of(split, saved, grads)
        return loss, call.input_grads(input_grads)

    def _whole_loss_step(
        self, cell: nn.Cell, call: _LossCall, hold_weight_grads: bool
    ) -> tuple[Any, MaybeTensors]:
        """The loss and every gradient in one call (one compiled graph in graph mode); the
        weight gradients added now, or held whole for ``W`` (recompute, dynamic shapes, or
        nothing to split)."""
        grads = self._stage_grads[call.stage]
        tape = self._kernel(
            ("loss_tape", call.stage, call.specs, call.label_specs, bool(call.grad_inputs)),
            lambda: Tape(
                self._make_loss(cell, call),
                grads.params,
                bool(call.grad_inputs),
                self._prepare,
                differentiated_output=0 if self._token_loss else None,
                dynamic_shapes=self.dynamic_shapes,
            ),
        )
        try:
            loss, (input_grads, weight_grads) = self._loss_and_gradients(
                "loss_step", _run_loss_step, tape, call
            )
        except ValueError as exc:
            error = loss_kind_error(call.where, exc)
            if error is not None:
                raise error from None
            raise
        check_loss(call.where, loss, self._token_loss)
        if hold_weight_grads:
            self._held[(call.stage, call.micro)] = weight_grads
        else:
            self._accumulators.accumulate(grads, weight_grads)
        return loss, call.input_grads(input_grads)

    def set_loss_scale(self, scale: Any) -> None:
        """The upstream gradient of the last stage's loss from the next :meth:`last_stage_step`
        on (a float, or a scalar tensor): a graph input, so changing it compiles nothing."""
        self._loss_scale = scale_tensor(scale)

    def last_stage_forward(self, stage: int, inputs: Tensors, labels: Tensors | None) -> Any:
        cell = self._stage(stage)
        if stage != self._last_stage:
            raise HookArgumentError(
                f"last_stage_forward(stage {stage}): the last stage is {self._last_stage}"
            )
        if labels is None:
            return self.stage_forward_only(stage, inputs)
        where = f"stage {stage}, forward only"
        specs = tensor_specs(inputs, f"{where} inputs")
        label_specs = tensor_specs(labels, f"{where} labels")
        loss = self._call(
            ("stage_loss", stage, specs, label_specs),
            lambda: self._prepare(make_stage_loss(cell, len(inputs), self._loss_fn)),
            *inputs,
            *labels,
        )
        check_loss(where, loss, self._token_loss)
        return loss
