"""The hook logic both executors share: bookkeeping, validation, kernel selection, the tape.

Everything that decides *what* runs lives here and in ``graph_exec.kernels``: which kernel a
hook needs, its cache key, what the forward keeps, and every check on the caller's arguments.
A subclass only decides *how* a freshly made kernel is turned into something callable
(compiled with ``mindspore.jit``, or left as the eager Python function), which is why graph and
pynative give the same numbers.

Differentiation goes through MindSpore's autograd tape (:class:`~graph_exec.executors.tape.Tape`)
around the kernel. By default a stage forward is recorded and its backward runs the recorded
bprop: no recompute. With ``recompute=True`` the forward runs plainly and keeps only its inputs;
the backward runs the forward again and takes its gradient in the same call, one compiled graph
in graph mode (:meth:`~graph_exec.executors.tape.Tape.recompute`). The preprocess backward is
always that recompute (its forward ran elsewhere, or long before), unless the caller used the
taped preprocess hooks.

Weight gradients come back from the tape as tensors and are added into the accumulators by
``GradBuffers.add``, in both modes: on CPU by address in C++ (``graph_exec._hostmath``, float32
and float64 accumulators; a gradient that is not contiguous goes through numpy), elsewhere eager
``ops.assign_add``, one per parameter: the fastest exact candidate of the ones measured. The last
stage runs its loss and gradient in one call, one compiled graph in graph mode
(:meth:`~graph_exec.executors.tape.Tape.value_and_gradient`), which returns the weight gradients
for the same host adds; nothing is recorded. Both choices were measured against their
alternatives; the tables, their commands and machines are in ``docs/performance.md``
("Executors": "Gradient accumulation candidates" and "The last stage in one graph"). The
arithmetic on all accumulators at once (end of step) is :mod:`~graph_exec.executors.whole_grads`.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from graph_exec import checks
from graph_exec.device import policy
from graph_exec.kernels import (
    GradBuffers,
    is_float,
    make_buffer,
    make_preprocess_forward,
    make_stage_forward,
    make_stage_loss,
)
from graph_exec.kernels.linear_split import probed
from graph_exec.msenv import prepare_mindspore

from .base import Executor, HeldState, MaybeTensors, Tensors
from .errors import ExecutorConfigError, HookArgumentError, HookOrderError, HookTypeError, UnknownStageError
from .jit_options import check_jit_options
from .kernel_cache import DEFAULT_KERNEL_CACHE_SIZE, KernelCache
from .signature import TensorSpec, kwargs_key, shape_free, split_kwargs, tensor_specs
from .split_backward import LinearWork, SplitTape, SplitTapes, make_split_tape, weight_gradients
from .tape import A_TUPLE, NOT_A_TUPLE, Tape, free_tapes
from .whole_grads import scale_tensor, whole_gradients


@dataclass(frozen=True)
class KeptForward:
    """What a forward leaves for its backward.

    ``args``: the kernel's positional tensors (the backward hands these very objects to the
    tape, which finds its recorded forward by them); ``outputs``: the output specs the
    cotangents are checked against; ``tape``: ``None`` when nothing is differentiated;
    ``recorded``: whether the forward ran under the tape (``False``: recompute at backward);
    ``grad_inputs``: positions of the inputs whose gradient the backward returns;
    ``split``: the probed tape of a forward recorded for the split backward (its linear layers'
    weight gradients left to ``W``), with ``saved`` the inputs those layers saved.
    """

    args: Tensors
    outputs: tuple[TensorSpec, ...]
    tape: Tape | None
    recorded: bool
    grad_inputs: tuple[int, ...] = ()
    split: SplitTape | None = None
    saved: Tensors = ()


def _run_backward(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.backward(args, sens)


def _run_recompute(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.recompute(args, sens)


def _run_loss_step(tape: Tape, args: Tensors, scale: Tensor) -> tuple[Any, tuple[tuple, tuple]]:
    return tape.value_and_gradient(args, scale)


def _run_split_loss_step(split: SplitTape, args: Tensors, scale: Tensor) -> tuple[Any, tuple[tuple, tuple]]:
    with probed(split.split):
        return split.tape.value_and_gradient(args, scale)


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
        recompute: bool = False,
        token_loss: bool = False,
        kernel_cache_size: int = DEFAULT_KERNEL_CACHE_SIZE,
        dynamic_shapes: bool = False,
        jit_options: Mapping[str, Any] | None = None,
        split_backward: bool = False,
    ) -> None:
        checks.boolean("recompute", recompute, ExecutorConfigError)
        checks.boolean("split_backward", split_backward, ExecutorConfigError)
        #: What every ``mindspore.jit`` of the graph executor is given (checked in both modes).
        self.jit_options = check_jit_options(jit_options, ExecutorConfigError)
        checks.boolean("token_loss", token_loss, ExecutorConfigError)
        #: One kernel per rank and dtype of its tensors, whatever their sizes (cache keys without
        #: sizes; the graph executor compiles them as ``GeneralisingKernel``s; see ``docs/shapes.md``).
        self.dynamic_shapes = checks.boolean("dynamic_shapes", dynamic_shapes, ExecutorConfigError)
        self._kernels = KernelCache(kernel_cache_size)
        self.steps_begun = 0  #: steps (walks of a plan) begun: the clock of adapting kernels
        prepare_mindspore()
        self.recompute = recompute
        self._stages = dict(sorted(stages.items()))
        self._preprocess = preprocess
        self._loss_fn = loss_fn
        self._token_loss = token_loss
        self._loss_scale = scale_tensor(loss_scale)
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
        self._buffer_index = {name: i for i, name in enumerate(self._buffers)}  # in _all_buffers
        # Low-precision gradients are cast to their float32 accumulators before the adds.
        self._casts = {
            id(g): tuple(
                b.dtype if b.dtype != p.dtype else None for p, b in zip(g.params, g.buffers, strict=True)
            )
            for g in grads.values()
        }
        # The whole-gradient arithmetic: on host memory (CPU fast path, float32/float64
        # accumulators), else by compiled kernels; chosen once.
        self._whole = whole_gradients(
            policy().host_gradient_math, self._all_buffers, self._buffers, self._call, self._prepare
        )
        self._kept: dict[tuple[int, int], KeptForward] = {}
        # Weight gradients an input backward computed, held until the stage's weight backward.
        self._held: dict[tuple[int, int], tuple | LinearWork] = {}
        # Stages whose forwards are recorded for the split backward (the linear layers' weight
        # gradients left to W): each from its first stage_backward_input on, every stage from
        # the first forward with split_backward (the schedule's body="zb").
        self._split_stages: set[int] = set(self._stages) if split_backward else set()
        # The probed tapes by signature (None: nothing to split), bounded like the kernels.
        self._split_tapes = SplitTapes(self._kernels.size)
        self._backward_done: set[tuple[int, int]] = set()
        self._kept_preprocess: dict[Hashable, KeptForward] = {}
        self._preprocess_done: set[Hashable] = set()
        self._preprocess_outputs: dict[Hashable, tuple[TensorSpec, ...]] = {}

    # ------------------------------------------------------------------ how kernels run

    @abstractmethod
    def _prepare(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """Turn a freshly made kernel into what runs it (compiled, or the function itself)."""

    def _on_new_kernel(self, first_call_seconds: float) -> None:
        """Called once per cached signature, after its first (possibly compiling) call."""

    def _cached(self, key: Hashable) -> Any:
        """The callable cached under ``key``, or ``None`` (the graph executor first drops every
        cached kernel when a parameter's storage moved); a hit becomes the most recently used."""
        return self._kernels.get(key)

    def _key(self, key: Hashable) -> Hashable:
        """The cache key: ``key`` itself, or without tensor sizes for dynamic shapes."""
        return shape_free(key) if self.dynamic_shapes else key

    def _kernel(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The callable cached under ``key``, made (not called) on first use."""
        key = self._key(key)
        kernel = self._cached(key)
        if kernel is None:
            kernel = self._kernels.put(key, make())
        return kernel

    def _call(self, key: Hashable, make: Callable[[], Callable[..., Any]], *args: Any) -> Any:
        """Run the callable cached under ``key``, making it on first use (``make`` prepares
        the kernels it wraps)."""
        key = self._key(key)
        kernel = self._cached(key)
        if kernel is not None:
            return kernel(*args)
        kernel = make()
        start = time.perf_counter()
        result = kernel(*args)
        self._on_new_kernel(time.perf_counter() - start)
        self._kernels.put(key, kernel)
        return result

    def _taped(self, key: Hashable, make: Callable[[], Tape], *args: Any) -> tuple[Any, Tape]:
        """Run (and record) the tape cached under ``key``; return its outputs and the tape
        (the most recently used entry after the call, so never the one just evicted)."""
        outputs = self._call(key, make, *args)
        return outputs, self._kernels[self._key(key)]

    def _backward(self, key: Hashable, kept: KeptForward, sens: Any) -> tuple[tuple, tuple]:
        """Input and weight gradients of a kept forward for upstream gradient ``sens``: from
        its recorded bprop, or, when it was not recorded, recomputed and differentiated in one
        go (one compiled graph in graph mode). Which of the two is fixed per ``key``."""
        run = _run_backward if kept.recorded else _run_recompute
        return self._call(key, lambda: run, kept.tape, kept.args, sens)

    def _accumulate(self, grads: GradBuffers, weight_grads: tuple) -> None:
        """The same adds in both modes: the fastest exact candidate (module docstring); a
        float16 or bfloat16 gradient is cast to its float32 accumulator first (exact)."""
        if weight_grads:
            casts = self._casts[id(grads)]
            if any(casts):
                weight_grads = tuple(
                    g if dtype is None else ops.cast(g, dtype)
                    for g, dtype in zip(weight_grads, casts, strict=True)
                )
            grads.add(*weight_grads)

    # ------------------------------------------------------------------ preprocess hooks

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
        present = _check_cotangents("preprocess", specs, cotangents)
        if not present:
            return
        tape = self._preprocess_tape(signature, make)
        kept = KeptForward(args, specs, tape, recorded=False)
        _, weight_grads = self._backward(("preprocess_backward", signature), kept, _sens(specs, cotangents))
        self._accumulate(grads, weight_grads)

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
        present = _check_cotangents(where, kept.outputs, cotangents)
        if kept.tape is not None and (present or kept.recorded):
            # Without any cotangent the gradient is zero; a recorded forward is still consumed.
            sens = _sens(kept.outputs, cotangents)
            _, weight_grads = self._backward(("preprocess_backward_taped", kept.outputs, present), kept, sens)
            if present:
                self._accumulate(self._preprocess_grads, weight_grads)
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
        grad_inputs = self._grad_inputs(stage, inputs)
        weights = self._stage_grads[stage].params
        tape: Tape | None = None
        recorded = False
        if grad_inputs or len(weights):
            tape_key = ("stage_tape", stage, specs, bool(grad_inputs))

            def make_tape() -> Tape:
                return Tape(
                    make_stage_forward(cell),
                    weights,
                    bool(grad_inputs),
                    self._prepare,
                    dynamic_shapes=self.dynamic_shapes,
                )

            split_key = ("stage_split_tape", stage, specs, bool(grad_inputs))
            if self._splits(stage):
                split = self._split_tape(split_key, cell, inputs, grad_inputs)
                if split is not None:
                    outputs = tuple(self._call_split(split, *inputs))
                    count = len(outputs) - split.saved_count
                    out_specs = tensor_specs(outputs[:count], f"stage {stage} outputs")
                    self._kept[key] = KeptForward(
                        tuple(inputs), out_specs, split.tape, True, grad_inputs, split, outputs[count:]
                    )
                    self._backward_done.discard(key)
                    return outputs[:count]
            if not self.recompute:
                outputs, tape = self._taped(tape_key, make_tape, *inputs)
                recorded = True
            else:
                tape = self._kernel(tape_key, make_tape)
        if not recorded:
            outputs = self._call(
                ("stage_forward", stage, specs), lambda: self._prepare(make_stage_forward(cell)), *inputs
            )
        outputs = tuple(outputs)
        out_specs = tensor_specs(outputs, f"stage {stage} outputs")
        self._kept[key] = KeptForward(tuple(inputs), out_specs, tape, recorded, grad_inputs)
        self._backward_done.discard(key)
        return outputs

    def _splits(self, stage: int) -> bool:
        """Whether stage ``stage``'s forwards are recorded for the split backward: from the first
        forward with ``split_backward``, else after its first input backward; only when the
        forward is recorded (not ``recompute``) for static shapes (the probes are shaped for one
        signature). Otherwise ``I`` holds a whole copy of the stage's weight gradients."""
        return stage in self._split_stages and not self.recompute and not self.dynamic_shapes

    def _split_tape(
        self,
        key: Hashable,
        cell: nn.Cell,
        inputs: Tensors,
        grad_inputs: tuple[int, ...],
        make_loss: Callable[[], Callable[..., Any]] | None = None,
    ) -> SplitTape | None:
        """The :class:`SplitTape` of ``key`` (the stage forward's, or with ``make_loss`` the last
        stage's loss step's), made on first use from one eager trace of the chunk on ``inputs``;
        ``None`` when no layer can be split exactly. Both are remembered (bounded)."""
        self._cached(key)  # the graph executor forgets every kernel, probed ones too, if storage moved
        if key in self._split_tapes:
            return self._split_tapes.get(key)
        stage, specs = key[1], key[2:-1]
        weight_key = ("stage_weight" if make_loss is None else "loss_weight", stage, *specs)
        made = make_split_tape(
            cell,
            self._stage_grads[stage].params,
            inputs,
            bool(grad_inputs),
            self._prepare,
            weight_key,
            make_loss,
        )
        return self._split_tapes.put(key, made)

    def _call_split(self, split: SplitTape, *args: Any) -> Any:
        """Run (and record) a probed forward; its first call compiles (graph mode) and counts."""
        if split.ran:
            return split(*args)
        start = time.perf_counter()
        outputs = split(*args)
        self._on_new_kernel(time.perf_counter() - start)
        split.ran = True
        return outputs

    def _forget_kernels(self) -> None:
        """Drop every made kernel, the probed tapes included (a parameter's storage moved)."""
        self._kernels.clear()
        self._split_tapes.clear()

    @property
    def split_buffer_bytes(self) -> int:
        """The zb buffers held now: probes, stores, counters of every cached probed tape."""
        return self._split_tapes.nbytes

    def bare_stage_forward(self, stage: int) -> Callable[..., Any]:
        return self._prepare(make_stage_forward(self._stage(stage)))

    def stage_backward(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        input_grads, weight_grads = self._stage_gradients("stage_backward", stage, micro, cotangents)
        self._add_weight_grads(stage, weight_grads)
        return input_grads

    def stage_backward_input(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        """The input gradients now; what the weight gradients need is held under
        ``(stage, micro)`` for :meth:`stage_backward_weight` (``docs/schedule.md``, "What is
        saved"): for a forward recorded for the split, the linear layers' inputs and output
        gradients (their weight gradients are computed in ``W``) and the other parameters'
        gradients; for one recorded before this stage's first input backward, every weight
        gradient. From this call on the stage's forwards are recorded for the split."""
        self._stage(stage)
        self._split_stages.add(stage)
        input_grads, weight_grads = self._stage_gradients("stage_backward_input", stage, micro, cotangents)
        self._held[(stage, micro)] = weight_grads
        return input_grads

    def _add_weight_grads(self, stage: int, weight_grads: tuple | LinearWork) -> None:
        """Accumulate held weight gradients; for :class:`LinearWork`, first compute the linear
        layers' ones (the ``W`` kernel: one compiled graph in graph mode)."""
        if isinstance(weight_grads, LinearWork):
            weight_grads = weight_gradients(weight_grads, self._call, self._prepare)
        self._accumulate(self._stage_grads[stage], weight_grads)

    def stage_backward_weight(self, stage: int, micro: int) -> None:
        self._stage(stage)
        weight_grads = self._held.pop((stage, micro), None)
        if weight_grads is None:
            raise HookOrderError(
                f"stage_backward_weight(stage {stage}, micro {micro}): no input backward "
                "(stage_backward_input, or last_stage_step with hold_weight_grads) holds its gradients"
            )
        self._add_weight_grads(stage, weight_grads)

    def _stage_gradients(
        self, hook: str, stage: int, micro: int, cotangents: MaybeTensors
    ) -> tuple[MaybeTensors, tuple | LinearWork]:
        """``(input gradients, weight gradients)`` of the forward kept for ``(stage, micro)``,
        which is dropped; the weight gradients are ``()`` when there are none to add, and a
        :class:`LinearWork` for a forward recorded for the split."""
        self._stage(stage)
        key = (stage, micro)
        kept = self._kept.get(key)
        if kept is None:
            why = "was already called for its forward" if key in self._backward_done else "has no forward"
            raise HookOrderError(f"{hook}(stage {stage}, micro {micro}) {why}")
        if key in self._held:
            raise HookOrderError(
                f"{hook}(stage {stage}, micro {micro}): the weight gradients of an earlier input "
                "backward of this micro-batch are still held (stage_backward_weight has not run)"
            )
        present = _check_cotangents(f"stage {stage}, micro {micro}", kept.outputs, cotangents)
        result: list[Tensor | None] = [None] * len(kept.args)
        weight_grads: tuple | LinearWork = ()
        if kept.split is not None:
            # The probed forward: gradients for the inputs, the probes (the linear layers'
            # output gradients) and the other parameters; none for the linear weights.
            split = kept.split
            sens = (*_sens(kept.outputs, cotangents), *split.saved_sens)
            input_grads, grads = self._backward(
                ("stage_split_backward", stage, kept.outputs, present), kept, sens
            )
            if present:
                weight_grads = LinearWork.of(split, kept.saved, grads)
                for position in kept.grad_inputs:
                    result[position] = input_grads[position]
        elif kept.tape is not None and (present or kept.recorded):
            # Without any cotangent every gradient is zero, but a recorded forward must still be
            # consumed (an abandoned one would stay in MindSpore's state).
            sens = _sens(kept.outputs, cotangents)
            input_grads, grads = self._backward(("stage_backward", stage, kept.outputs, present), kept, sens)
            if present:
                weight_grads = grads
                for position in kept.grad_inputs:
                    result[position] = input_grads[position]
        if not present:
            for position in kept.grad_inputs:
                result[position] = ops.zeros_like(kept.args[position])
        del self._kept[key]
        self._backward_done.add(key)
        return tuple(result), weight_grads

    def last_stage_step(
        self, stage: int, micro: int, inputs: Tensors, labels: Tensors, hold_weight_grads: bool = False
    ) -> tuple[Any, MaybeTensors]:
        cell = self._stage(stage)
        if hold_weight_grads and (stage, micro) in self._held:
            raise HookOrderError(
                f"last_stage_step(stage {stage}, micro {micro}): the weight gradients of an earlier "
                "step of this micro-batch are still held (stage_backward_weight has not run)"
            )
        if stage != self._last_stage:
            raise HookArgumentError(
                f"last_stage_step(stage {stage}, micro {micro}): the last stage is {self._last_stage}"
            )
        where = f"stage {stage}, micro {micro}"
        specs = tensor_specs(inputs, f"{where} inputs")
        label_specs = tensor_specs(labels, f"{where} labels")
        grads = self._stage_grads[stage]
        grad_inputs = self._grad_inputs(stage, inputs)
        args = (*inputs, *labels)

        def make_loss() -> Callable[..., Any]:
            return make_stage_loss(cell, len(inputs), self._loss_fn)

        result: list[Tensor | None] = [None] * len(inputs)
        if not grad_inputs and not len(grads):
            loss = self._call(
                ("stage_loss", stage, specs, label_specs), lambda: self._prepare(make_loss()), *args
            )
            _check_loss(where, loss, self._token_loss)
            if hold_weight_grads:
                self._held[(stage, micro)] = ()
            return loss, tuple(result)
        if hold_weight_grads and not self.dynamic_shapes:
            traced = args if self._loss_fn is None else inputs  # what the cell itself is called with
            key = ("loss_split_tape", stage, specs, label_specs, bool(grad_inputs))
            split = self._split_tape(key, cell, traced, grad_inputs, make_loss)
            if split is not None:
                output, (input_grads, grads) = self._call(
                    ("loss_split_step", stage, specs, label_specs),
                    lambda: _run_split_loss_step,
                    split,
                    args,
                    self._loss_scale,
                )
                count = split.saved_count
                head, saved = tuple(output[:-count]), tuple(output[-count:])
                if self._token_loss and len(head) == 1:
                    raise HookArgumentError(f"last_stage_step({where}): {_TOKEN_LOSS_NEEDED}, got one tensor")
                if not self._token_loss and len(head) != 1:
                    raise HookArgumentError(f"last_stage_step({where}): {_SCALAR_LOSS_NEEDED}, got a tuple")
                loss = head if self._token_loss else head[0]
                _check_loss(where, loss, self._token_loss)
                self._held[(stage, micro)] = LinearWork.of(split, saved, grads)
                for position in grad_inputs:
                    result[position] = input_grads[position]
                return loss, tuple(result)
        tape = self._kernel(
            ("loss_tape", stage, specs, label_specs, bool(grad_inputs)),
            lambda: Tape(
                make_loss(),
                grads.params,
                bool(grad_inputs),
                self._prepare,
                differentiated_output=0 if self._token_loss else None,
                dynamic_shapes=self.dynamic_shapes,
            ),
        )
        try:
            loss, (input_grads, weight_grads) = self._call(
                ("loss_step", stage, specs, label_specs), lambda: _run_loss_step, tape, args, self._loss_scale
            )
        except ValueError as exc:
            if str(exc) == NOT_A_TUPLE:
                raise HookArgumentError(
                    f"last_stage_step({where}): {_TOKEN_LOSS_NEEDED}, got one tensor"
                ) from None
            if str(exc) == A_TUPLE:
                raise HookArgumentError(
                    f"last_stage_step({where}): {_SCALAR_LOSS_NEEDED}, got a tuple"
                ) from None
            raise
        _check_loss(where, loss, self._token_loss)
        if hold_weight_grads:
            self._held[(stage, micro)] = weight_grads
        else:
            self._accumulate(grads, weight_grads)
        for position in grad_inputs:
            result[position] = input_grads[position]
        return loss, tuple(result)

    def set_loss_scale(self, scale: Any) -> None:
        """The upstream gradient of the last stage's loss from the next :meth:`last_stage_step`
        on (a float, or a scalar tensor): a graph input, so changing it compiles nothing."""
        self._loss_scale = scale_tensor(scale)

    # ------------------------------------------------------------------ forward only

    def stage_forward_only(self, stage: int, inputs: Tensors) -> Tensors:
        cell = self._stage(stage)
        specs = tensor_specs(inputs, f"stage {stage} inputs")
        outputs = self._call(
            ("stage_forward", stage, specs), lambda: self._prepare(make_stage_forward(cell)), *inputs
        )
        return tuple(outputs)

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
        _check_loss(where, loss, self._token_loss)
        return loss

    # ------------------------------------------------------------------ gradients as a whole

    def multiply_grads(self, factor: Any) -> None:
        """Multiply every accumulator in place by ``factor`` (a float or a scalar tensor)."""
        if self._buffers:
            self._whole.multiply(factor)

    def grad_norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        """This rank's share of the ``norm_type``-norm of the accumulators of ``names``: the
        sum of ``|g| ** p`` (the largest ``|g|`` for ``inf``), a float32 scalar (0 for none;
        float64 on the host path, which adds in float64)."""
        names = tuple(name for name in names if self._buffers[name].size)  # an empty one adds nothing
        if not names:
            return ops.zeros((), ms.float32)
        return self._whole.norm_part(names, norm_type)

    def unscale_and_check(
        self, factor: float, names: Sequence[str], norm_type: float | None
    ) -> tuple[bool, float]:
        """Every accumulator multiplied in place by ``factor``; then ``(all finite, the
        norm_type-norm share of names)`` from one kernel (one host pass on the CPU fast path)."""
        if not self._buffers:
            return True, 0.0
        counted = tuple(self._buffer_index[name] for name in names if self._buffers[name].size)
        return self._whole.unscale_and_check(factor, counted, norm_type)

    def set_aside_grads(self) -> None:
        """Keep a copy of every accumulator and zero them: what follows accumulates this step's
        gradients alone, until :meth:`add_back_grads` adds the copy back."""
        if self._buffers:
            self._whole.set_aside()

    def add_back_grads(self) -> None:
        """Add what :meth:`set_aside_grads` kept to every accumulator."""
        if self._buffers:
            self._whole.add_back()

    # ------------------------------------------------------------------ gradients and state

    def grads(self) -> dict[str, Any]:
        """The live accumulators (no copies), keyed by the name of the parameter they belong to."""
        return {name: buffer for name, buffer in self._buffers.items()}

    def zero_grad(self) -> None:
        if self._buffers:
            self._whole.zero()

    def kept(self) -> Sequence[Hashable]:
        """Stage keys ``(stage, micro)``, then the key of each taped preprocess forward whose
        backward has not run, then ``("weight_grads", stage, micro)`` for each micro-batch whose
        weight gradients an input backward holds for its weight backward."""
        return [*self._kept, *self._kept_preprocess, *(("weight_grads", *key) for key in self._held)]

    def begin_step(self) -> None:
        self.steps_begun += 1

    def held_state(self) -> HeldState:
        """The live dicts of kept forwards and held weight gradients (no copies: read per step)."""
        return HeldState(self._kept, self._kept_preprocess, self._held)

    def drop_kept(self, consume: bool = True) -> None:
        """Forget every kept forward; a recorded tape is consumed by a backward with zero
        upstream gradients whose results are discarded (this frees it without touching other
        executors' tapes, as :func:`free_tapes` would); if that fails, every tape is freed.

        ``consume=False`` runs none of that: with asynchronous dispatch, a backward run while a
        timed-out receive was still blocked in MindSpore on the communication thread crashed the
        process (seen on CPU with the fast paths off). The recorded forwards then stay in
        MindSpore's state until the process ends, which after such a failure is the next thing
        to happen anyway."""
        recorded = (
            [k for k in (*self._kept.values(), *self._kept_preprocess.values()) if k.recorded]
            if consume
            else []
        )
        self._kept.clear()
        self._held.clear()
        self._backward_done.clear()
        self._kept_preprocess.clear()
        self._preprocess_done.clear()
        for kept in recorded:
            if not _release(kept):
                break

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


def _sens(outputs: tuple[TensorSpec, ...], cotangents: MaybeTensors) -> tuple[Any, ...]:
    """The upstream gradient of a tuple-output kernel: the cotangents, zeros where missing."""
    return tuple(
        ops.zeros(spec.shape, spec.dtype) if cotangent is None else cotangent
        for cotangent, spec in zip(cotangents, outputs, strict=True)
    )


def _release(kept: KeptForward) -> bool:
    """Consume a recorded forward without using its gradients; on failure free every tape of
    the process instead and return ``False``."""
    saved_sens = kept.split.saved_sens if kept.split is not None else ()
    try:
        kept.tape.backward(kept.args, (*_sens(kept.outputs, (None,) * len(kept.outputs)), *saved_sens))
    except Exception:  # the step is being aborted already: never mask its error
        free_tapes()
        return False
    return True


#: What a per-token loss function must return.
_TOKEN_LOSS_NEEDED = (
    "loss_reduction='token' needs the loss (loss_fn, or the last chunk without one) to return "
    "(sum_of_token_losses, token_count)"
)


#: What a per-micro-batch loss function must return.
_SCALAR_LOSS_NEEDED = (
    "the loss must be a scalar tensor (a per-token loss returning (sum, count) needs loss_reduction='token')"
)


def _check_scalar_loss(where: str, loss: Any) -> None:
    if not isinstance(loss, Tensor):
        raise HookArgumentError(f"last_stage_step({where}): {_SCALAR_LOSS_NEEDED}, got {type(loss).__name__}")
    if tuple(loss.shape) != ():
        raise HookArgumentError(
            f"last_stage_step({where}): the loss must be a scalar, got shape {list(loss.shape)}"
        )


def _check_loss(where: str, loss: Any, token_loss: bool) -> None:
    """A scalar loss, or with ``token_loss`` a (scalar sum, scalar count) pair."""
    if not token_loss:
        _check_scalar_loss(where, loss)
        return
    if isinstance(loss, Tensor):
        raise HookArgumentError(f"last_stage_step({where}): {_TOKEN_LOSS_NEEDED}, got one tensor")
    if not isinstance(loss, tuple | list) or len(loss) != 2 or not all(isinstance(t, Tensor) for t in loss):
        got = f"{len(loss)} values" if isinstance(loss, tuple | list) else type(loss).__name__
        raise HookArgumentError(f"last_stage_step({where}): {_TOKEN_LOSS_NEEDED}, got {got}")
    for part, tensor in zip(("sum_of_token_losses", "token_count"), loss, strict=True):
        if tuple(tensor.shape) != ():
            raise HookArgumentError(
                f"last_stage_step({where}): {part} must be a scalar, got shape {list(tensor.shape)}"
            )


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
