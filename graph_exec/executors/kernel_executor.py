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

Weight gradients come back from the tape as tensors and are added into the accumulators
(:mod:`~graph_exec.executors.accumulators`, which also owns the arithmetic on all of them at
once). The last stage runs its loss and gradient in one call, one compiled graph in graph mode
(:meth:`~graph_exec.executors.tape.Tape.value_and_gradient`), which returns the weight gradients
for the same adds; nothing is recorded. Both choices were measured against their
alternatives; the tables, their commands and machines are in ``docs/performance.md``
("Executors": "Gradient accumulation candidates" and "The last stage in one graph").

The other concerns live beside this module: the preprocess hooks
(:mod:`~graph_exec.executors.preprocess_hooks`), the last stage's loss step in named paths
(:mod:`~graph_exec.executors.last_stage`), what a forward keeps
(:mod:`~graph_exec.executors.kept`), the checks on arguments and losses
(:mod:`~graph_exec.executors.hook_checks`), the zb split
(:mod:`~graph_exec.executors.split_backward`) and the kernel cache
(:mod:`~graph_exec.executors.kernel_cache`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from mindspore import Tensor, nn, ops

from graph_exec import checks
from graph_exec.device import policy
from graph_exec.kernels import is_float, make_stage_forward
from graph_exec.msenv import prepare_mindspore

from .accumulators import GradAccumulators
from .base import Executor, HeldState, MaybeTensors, Tensors
from .errors import ExecutorConfigError, HookOrderError, UnknownStageError
from .hook_checks import check_cotangents
from .jit_options import check_jit_options
from .kept import KeptForward, release, upstream_grads
from .kernel_cache import DEFAULT_KERNEL_CACHE_SIZE, KernelCache
from .last_stage import LastStageHooks
from .preprocess_hooks import PreprocessHooks
from .signature import TensorSpec, shape_free, tensor_specs
from .split_backward import LinearWork, SplitTape, SplitTapes, make_split_tape, weight_gradients
from .tape import Tape
from .whole_grads import scale_tensor


def _run_backward(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.backward(args, sens)


def _run_recompute(tape: Tape, args: Tensors, sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tape.recompute(args, sens)


class KernelExecutor(PreprocessHooks, LastStageHooks, Executor):
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
        # The whole-gradient arithmetic: on host memory (CPU fast path, float32/float64
        # accumulators), else by compiled kernels; chosen once.
        self._accumulators = GradAccumulators(owners, policy().host_gradient_math, self._call, self._prepare)
        self._buffers = self._accumulators.buffers  # name -> accumulator (the same dict)
        grads = self._accumulators.by_owner
        self._stage_grads = {k: grads[f"stage {k}"] for k in self._stages}
        self._preprocess_grads = grads.get("preprocess")
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
        self._accumulators.accumulate(self._stage_grads[stage], weight_grads)

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
        present = check_cotangents(f"stage {stage}, micro {micro}", kept.outputs, cotangents)
        result: list[Tensor | None] = [None] * len(kept.args)
        weight_grads: tuple | LinearWork = ()
        if kept.split is not None:
            # The probed forward: gradients for the inputs, the probes (the linear layers'
            # output gradients) and the other parameters; none for the linear weights.
            split = kept.split
            sens = (*upstream_grads(kept.outputs, cotangents), *split.saved_sens)
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
            sens = upstream_grads(kept.outputs, cotangents)
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

    # ------------------------------------------------------------------ forward only

    def stage_forward_only(self, stage: int, inputs: Tensors) -> Tensors:
        cell = self._stage(stage)
        specs = tensor_specs(inputs, f"stage {stage} inputs")
        outputs = self._call(
            ("stage_forward", stage, specs), lambda: self._prepare(make_stage_forward(cell)), *inputs
        )
        return tuple(outputs)

    # ------------------------------------------------------------------ gradients as a whole

    def multiply_grads(self, factor: Any) -> None:
        """Multiply every accumulator in place by ``factor`` (a float or a scalar tensor)."""
        self._accumulators.multiply(factor)

    def grad_norm_part(self, names: Sequence[str], norm_type: float) -> Tensor:
        """This rank's share of the ``norm_type``-norm of the accumulators of ``names``: the
        sum of ``|g| ** p`` (the largest ``|g|`` for ``inf``), a float32 scalar (0 for none;
        float64 on the host path, which adds in float64)."""
        return self._accumulators.norm_part(names, norm_type)

    def unscale_and_check(
        self, factor: float, names: Sequence[str], norm_type: float | None
    ) -> tuple[bool, float]:
        """Every accumulator multiplied in place by ``factor``; then ``(all finite, the
        norm_type-norm share of names)`` from one kernel (one host pass on the CPU fast path)."""
        return self._accumulators.unscale_and_check(factor, names, norm_type)

    def set_aside_grads(self) -> None:
        """Keep a copy of every accumulator and zero them: what follows accumulates this step's
        gradients alone, until :meth:`add_back_grads` adds the copy back."""
        self._accumulators.set_aside()

    def add_back_grads(self) -> None:
        """Add what :meth:`set_aside_grads` kept to every accumulator."""
        self._accumulators.add_back()

    # ------------------------------------------------------------------ gradients and state

    def grads(self) -> dict[str, Any]:
        """The live accumulators (no copies), keyed by the name of the parameter they belong to."""
        return {name: buffer for name, buffer in self._buffers.items()}

    def zero_grad(self) -> None:
        self._accumulators.zero()

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

    def release_forward(self, stage: int, micro: int) -> None:
        kept = self._kept.pop((stage, micro), None)
        self._backward_done.discard((stage, micro))
        if kept is not None and kept.recorded:
            release(kept)

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
            if not release(kept):
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
