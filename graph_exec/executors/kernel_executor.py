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
``ops.assign_add``, one per parameter. Candidates, measured side by side with
``python -m graph_exec.benchmarks.executor_speed --only accumulation`` (4 taped forwards then 4
backwards, ms for the whole round, p10 / p50; this 2-core machine, otherwise idle, one run, with
``MS_DEV_HOST_BLOCKING_RUN`` as ``prepare_mindspore`` sets it):

    candidate                                dense32, 16   dense256, 16   LM block, 12
    eager assign_add per parameter            4.58 / 4.80   10.52 / 11.19   9.54 / 9.84
    numpy add through asnumpy() views         3.87 / 3.99    9.29 / 9.97    8.80 / 9.09
    C++ add by address (the executors, CPU)   3.30 / 3.42    8.75 / 9.58    8.39 / 8.57
    one jitted add, buffers closed over       4.46 / 4.83   10.68 / 11.59   9.58 / 10.02
    one jitted add, buffers as arguments      5.01 / 5.38   11.24 / 12.53   9.98 / 10.24
    one jitted add per 4 micro-batches        4.32 / 4.62   10.62 / 11.60   9.32 / 9.76
    no accumulation (floor)                   3.17 / 3.28    8.54 / 9.32    8.33 / 8.45

(chunk, number of gradient tensors).

All candidates are exact (the same float32 additions, each buffer in micro-batch order). The
host adds win on every chunk: they save the dispatch of one eager MindSpore op per parameter,
and adding by address also saves the two ``asnumpy()`` views per parameter that numpy needs
(about 4.6 us each, mostly numpy parsing the buffer's format string): 16 parameters take about
28 us instead of 125 us, which brings accumulation to within noise of the floor. They rely on
CPU facts (a tensor's ``data_ptr()`` is its host memory, waits for the op that makes it, and
writes there are seen by later ops and graphs; measured and tested) and wait for MindSpore's
queued work first, so they are used on CPU only. Among the others none beats the eager
``assign_add`` by more than noise: on its own a jitted add of 4 micro-batches' dense32 gradients
takes 0.66 ms against 1.10 ms for the 64 eager adds, but while taped forwards are in flight
MindSpore runs every jitted call through its grad-recording path (``grad_jit``), which eats the
saving; an executor that held gradients for it (tried) was no faster on any chunk and held their
memory, so it was not kept. A flat buffer per chunk was not tried: the accumulators must stay
one live Parameter per parameter (optimizers, the broadcast and the gradient all-reduce read
them by name).

The last stage runs its loss and gradient in one call, one compiled graph in graph mode
(:meth:`~graph_exec.executors.tape.Tape.value_and_gradient`), which returns the weight gradients
for the same host adds; nothing is recorded. Same script (``--only last``), one micro-batch, ms,
p10 / p50 / p90 of the first of three runs on 2026-12-01, then the p50 of the other two:

    last stage     fused jit,               taped loss + bprop,    one graph, host adds
                   in-graph assign_add      host adds (before)     (this executor)
    LM, 3 blocks   13.3 / 17.0 / 21.0       20.3 / 27.9 / 33.4     13.6 / 18.6 / 23.4
                   16.4, 22.8               29.1, 40.9             19.9, 27.9
    dense32         3.6 /  4.3 /  5.3        5.6 /  9.2 / 10.2      3.4 /  5.6 /  6.3
                    5.9,  6.6               12.6, 13.6              7.2,  7.7

Before ``MS_DEV_HOST_BLOCKING_RUN`` (see the README's executor section) a compiled graph that
wrote or returned weight gradients fell into a slow mode at random (the fused graph's p90 was
about 75 ms on the LM stage, p50 14-140 ms when it returned the gradients), so the last stage
used the tape. With it, the one graph is 1.46-1.50x (LM) and 1.66-1.78x (dense32) faster than
the tape here; writing the accumulators inside the graph would save another 9-23 % of its
time, but the executors keep one way of accumulating (host adds) for every hook and both modes.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from graph_exec import checks
from graph_exec.device import policy
from graph_exec.kernels import (
    HOST_DTYPES,
    GradBuffers,
    HostGradients,
    is_float,
    make_add_back,
    make_buffer,
    make_norm_part,
    make_preprocess_forward,
    make_scale_grads,
    make_set_aside,
    make_stage_forward,
    make_stage_loss,
    make_unscale_and_check,
    make_zero_grads,
)
from graph_exec.msenv import prepare_mindspore

from .base import Executor, MaybeTensors, Tensors
from .errors import ExecutorConfigError, HookArgumentError, HookOrderError, HookTypeError, UnknownStageError
from .kernel_cache import DEFAULT_KERNEL_CACHE_SIZE, KernelCache
from .signature import TensorSpec, kwargs_key, shape_free, split_kwargs, tensor_specs
from .tape import A_TUPLE, NOT_A_TUPLE, Tape, free_tapes


@dataclass(frozen=True)
class KeptForward:
    """What a forward leaves for its backward.

    ``args``: the kernel's positional tensors (the backward hands these very objects to the
    tape, which finds its recorded forward by them); ``outputs``: the output specs the
    cotangents are checked against; ``tape``: ``None`` when nothing is differentiated;
    ``recorded``: whether the forward ran under the tape (``False``: recompute at backward);
    ``grad_inputs``: positions of the inputs whose gradient the backward returns.
    """

    args: Tensors
    outputs: tuple[TensorSpec, ...]
    tape: Tape | None
    recorded: bool
    grad_inputs: tuple[int, ...] = ()


def _run_backward(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.backward(args, sens)


def _run_recompute(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.recompute(args, sens)


def _run_loss_step(tape: Tape, args: Tensors, scale: Tensor) -> tuple[Any, tuple[tuple, tuple]]:
    return tape.value_and_gradient(args, scale)


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
    ) -> None:
        checks.boolean("recompute", recompute, ExecutorConfigError)
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
        self._loss_scale = _scale_tensor(loss_scale)
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
        self._kept_grads: ParameterTuple | None = None  # made by the first set_aside_grads()
        # The whole-gradient arithmetic on host memory (CPU fast path, float32/float64
        # accumulators), else compiled (None).
        self._host = (
            HostGradients(self._all_buffers)
            if policy().host_gradient_math and all(b.dtype in HOST_DTYPES for b in self._all_buffers)
            else None
        )
        self._kept: dict[tuple[int, int], KeptForward] = {}
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

    def bare_stage_forward(self, stage: int) -> Callable[..., Any]:
        return self._prepare(make_stage_forward(self._stage(stage)))

    def stage_backward(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        self._stage(stage)
        key = (stage, micro)
        kept = self._kept.get(key)
        if kept is None:
            why = "was already called for its forward" if key in self._backward_done else "has no forward"
            raise HookOrderError(f"stage_backward(stage {stage}, micro {micro}) {why}")
        present = _check_cotangents(f"stage {stage}, micro {micro}", kept.outputs, cotangents)
        result: list[Tensor | None] = [None] * len(kept.args)
        if kept.tape is not None and (present or kept.recorded):
            # Without any cotangent every gradient is zero, but a recorded forward must still be
            # consumed (an abandoned one would stay in MindSpore's state).
            sens = _sens(kept.outputs, cotangents)
            input_grads, weight_grads = self._backward(
                ("stage_backward", stage, kept.outputs, present), kept, sens
            )
            if present:
                self._accumulate(self._stage_grads[stage], weight_grads)
                for position in kept.grad_inputs:
                    result[position] = input_grads[position]
        if not present:
            for position in kept.grad_inputs:
                result[position] = ops.zeros_like(kept.args[position])
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
        args = (*inputs, *labels)

        def make_loss() -> Callable[..., Any]:
            return make_stage_loss(cell, len(inputs), self._loss_fn)

        result: list[Tensor | None] = [None] * len(inputs)
        if not grad_inputs and not len(grads):
            loss = self._call(
                ("stage_loss", stage, specs, label_specs), lambda: self._prepare(make_loss()), *args
            )
            _check_loss(where, loss, self._token_loss)
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
        self._accumulate(grads, weight_grads)
        for position in grad_inputs:
            result[position] = input_grads[position]
        return loss, tuple(result)

    def set_loss_scale(self, scale: Any) -> None:
        """The upstream gradient of the last stage's loss from the next :meth:`last_stage_step`
        on (a float, or a scalar tensor): a graph input, so changing it compiles nothing."""
        self._loss_scale = _scale_tensor(scale)

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

    def scale_grads(self, factor: Any) -> None:
        """Multiply every accumulator in place by ``factor`` (a float or a scalar tensor)."""
        if not self._buffers:
            return
        if self._host is not None:
            self._host.scale(float(factor.asnumpy() if isinstance(factor, Tensor) else factor))
            return
        buffers = self._all_buffers
        self._call(("grad_scale",), lambda: self._prepare(make_scale_grads(buffers)), _scale_tensor(factor))

    def grad_norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        """This rank's share of the ``norm_type``-norm of the accumulators of ``names``: the
        sum of ``|g| ** p`` (the largest ``|g|`` for ``inf``), a float32 scalar (0 for none;
        float64 on the host path, which adds in float64)."""
        names = tuple(name for name in names if self._buffers[name].size)  # an empty one adds nothing
        if not names:
            return ops.zeros((), ms.float32)
        if self._host is not None:
            counted = [self._buffer_index[name] for name in names]
            return Tensor(np.float64(self._host.norm_part(counted, norm_type)))  # the host's float64
        buffers = ParameterTuple([self._buffers[name] for name in names])
        return self._call(
            ("grad_norm", names, norm_type), lambda: self._prepare(make_norm_part(buffers, norm_type))
        )

    def unscale_and_check(
        self, factor: float, names: Sequence[str], norm_type: float | None
    ) -> tuple[bool, float]:
        """Every accumulator multiplied in place by ``factor``; then ``(all finite, the
        norm_type-norm share of names)`` from one kernel (one host pass on the CPU fast path)."""
        if not self._buffers:
            return True, 0.0
        counted = tuple(self._buffer_index[name] for name in names if self._buffers[name].size)
        if self._host is not None:
            return self._host.unscale_and_check(factor, counted, norm_type)
        buffers = self._all_buffers
        pair = self._call(
            ("grad_unscale_check", counted, norm_type),
            lambda: self._prepare(make_unscale_and_check(buffers, counted, norm_type)),
            _scale_tensor(factor),
        ).asnumpy()  # read through the tensor
        return bool(pair[0] == 1.0), float(pair[1])

    def set_aside_grads(self) -> None:
        """Keep a copy of every accumulator and zero them: what follows accumulates this step's
        gradients alone, until :meth:`add_back_grads` adds the copy back."""
        if not self._buffers:
            return
        if self._host is not None:
            self._host.set_aside()
            return
        if self._kept_grads is None:
            self._kept_grads = ParameterTuple(
                [
                    Parameter(ops.zeros_like(b), name=f"kept.{b.name}", requires_grad=False)
                    for b in self._all_buffers
                ]
            )
        kept = self._kept_grads
        self._call(("grad_set_aside",), lambda: self._prepare(make_set_aside(self._all_buffers, kept)))

    def add_back_grads(self) -> None:
        """Add what :meth:`set_aside_grads` kept to every accumulator."""
        if self._host is not None:
            self._host.add_back()
            return
        if self._kept_grads is not None:
            kept = self._kept_grads
            self._call(("grad_add_back",), lambda: self._prepare(make_add_back(self._all_buffers, kept)))

    # ------------------------------------------------------------------ gradients and state

    def grads(self) -> dict[str, Any]:
        """The live accumulators (no copies), keyed by the name of the parameter they belong to."""
        return {name: buffer for name, buffer in self._buffers.items()}

    def zero_grad(self) -> None:
        if not self._buffers:
            return
        if self._host is not None:
            self._host.zero()
            return
        self._call(("zero_grad",), lambda: self._prepare(make_zero_grads(self._all_buffers)))

    def kept(self) -> Sequence[Hashable]:
        """Stage keys ``(stage, micro)``, then the key of each taped preprocess forward whose
        backward has not run."""
        return [*self._kept, *self._kept_preprocess]

    def begin_step(self) -> None:
        self.steps_begun += 1

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
    try:
        kept.tape.backward(kept.args, _sens(kept.outputs, (None,) * len(kept.outputs)))
    except Exception:  # the step is being aborted already: never mask its error
        free_tapes()
        return False
    return True


#: What a per-token loss function must return.
_TOKEN_LOSS_NEEDED = (
    "loss_reduction='token' needs the loss (loss_fn, or the last chunk without one) to return "
    "(sum_of_token_losses, token_count)"
)


def _scale_tensor(scale: Any) -> Tensor:
    """A loss scale or factor as the float32 scalar tensor the kernels take."""
    if isinstance(scale, Tensor):
        return scale.astype(ms.float32).reshape(())
    return Tensor(float(scale), ms.float32)


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
