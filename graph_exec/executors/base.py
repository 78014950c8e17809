"""The hook interface: the only way the runtime reaches compute.

The runtime walks a plan and never touches MindSpore autograd; at each compute step it calls
one of these hooks. Two implementations exist (``graph``: kernels compiled with
``mindspore.jit``; ``pynative``: the very same kernels called eagerly) and they must give the
same numbers, so everything that defines *what* is computed lives in the shared kernels and
everything here is about *how* it is dispatched and cached.

Conventions shared by every hook:

* tensors travel as tuples, one entry per stage input or output, in a fixed order;
* an input gradient is ``None`` for an input that cannot require a gradient (integer token
  ids) — the runtime then sends nothing for it;
* a cotangent may be ``None`` for an output that received no gradient; it counts as zeros;
* weight gradients are *accumulated* into per-parameter buffers owned by the executor, summed
  over micro-batches and over calls until :meth:`Executor.zero_grad`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Tensors = tuple[Any, ...]
"""A tuple of ``mindspore.Tensor`` (typed loosely so this module imports without MindSpore)."""
MaybeTensors = tuple[Any | None, ...]


@dataclass
class CompileStats:
    """How often and how long the executor compiled (zero for the pynative executor), and its
    kernel cache.

    ``compilations`` counts first calls of a cached kernel (each compiles in graph mode);
    ``mindspore_compilations`` is MindSpore's own count of ``mindspore.jit`` graphs compiled in
    this process since the executor was made (``None`` where MindSpore does not expose it, and
    in pynative mode): it also sees recompilations inside one cached kernel, and graphs other
    code of the process compiled. ``cached_kernels`` / ``evictions``: entries in the bounded
    kernel cache and how many it dropped for room; ``cached_bytes``: the tensors its entries
    say they hold (``KernelCache.nbytes``).
    """

    compilations: int = 0
    compile_seconds: float = 0.0
    mindspore_compilations: int | None = None
    cached_kernels: int = 0
    evictions: int = 0
    cached_bytes: int = 0


@dataclass(frozen=True)
class HeldState:
    """What an executor holds between hook calls, for the memory accounting
    (:mod:`graph_exec.runtime.memory_account`): live views, read, never changed by the reader.

    ``forwards``: the kept stage forwards by ``(stage, micro)``; ``preprocess``: the taped
    preprocess forwards by key (each with ``args``, ``outputs`` specs and ``recorded``);
    ``weight_grads``: the weight gradients a split backward's input half holds, by ``(stage, micro)``.
    """

    forwards: Mapping[Hashable, Any] = field(default_factory=dict)
    preprocess: Mapping[Hashable, Any] = field(default_factory=dict)
    weight_grads: Mapping[Hashable, tuple] = field(default_factory=dict)


class Executor(ABC):
    """Runs the compute of one rank: its stage chunks and its preprocess replica."""

    #: ``"graph"`` or ``"pynative"``.
    mode: str

    @abstractmethod
    def broadcast_tensors(self) -> list[Any]:
        """The trainable preprocess parameters, in a fixed order (the ``BCAST`` payload)."""

    @abstractmethod
    def preprocess_forward(self, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        """Run the preprocess on one micro-batch; the outputs are detached (no graph kept)."""

    @abstractmethod
    def preprocess_backward(
        self, inputs: Tensors, kwargs: Mapping[str, Any], cotangents: MaybeTensors
    ) -> None:
        """Recompute the preprocess from ``inputs`` and accumulate its parameter gradients."""

    @abstractmethod
    def preprocess_forward_taped(self, key: Hashable, inputs: Tensors, kwargs: Mapping[str, Any]) -> Tensors:
        """Run the preprocess on one micro-batch under the autograd tape and keep its state under
        ``key`` (any hashable; counted by :meth:`kept`, freed by :meth:`drop_kept`) for
        :meth:`preprocess_backward_taped`. For a caller that runs the preprocess where its
        backward will also run (the non-transposed baseline, or a schedule with
        ``keep_preprocess_tape``), so the backward need not recompute.
        With ``recompute=True`` only the inputs are kept and the backward recomputes."""

    @abstractmethod
    def preprocess_backward_taped(self, key: Hashable, cotangents: MaybeTensors) -> None:
        """Accumulate the preprocess parameter gradients of the forward kept under ``key`` for
        the output ``cotangents`` (``None`` entries count as zeros), then free its state."""

    @abstractmethod
    def stage_forward(self, stage: int, micro: int, inputs: Tensors) -> Tensors:
        """Run a stage chunk; keep what its backward needs under ``(stage, micro)`` (the taped
        forward by default, only the inputs with ``recompute=True``)."""

    @abstractmethod
    def bare_stage_forward(self, stage: int) -> Callable[..., Any]:
        """Stage ``stage``'s forward kernel, prepared as this executor prepares it (compiled in
        graph mode), to be called without the hook path: no signature, cache, tape or kept
        state. What a hook call costs beyond it is the executor's dispatch cost (the harness
        measures it so the cost model can charge it per step)."""

    @abstractmethod
    def stage_backward(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        """Back-propagate a stage chunk: return input gradients, accumulate weight gradients,
        and drop what the forward kept for ``(stage, micro)``."""

    @abstractmethod
    def stage_backward_input(self, stage: int, micro: int, cotangents: MaybeTensors) -> MaybeTensors:
        """The first half of a split backward (the zero-bubble body's ``I s.m``): return the
        input gradients and drop what the forward kept, as :meth:`stage_backward` does, but hold
        what the weight gradients need under ``(stage, micro)`` instead of accumulating them,
        until :meth:`stage_backward_weight` (the linear layers' inputs and output gradients, or
        whole gradients: ``docs/schedule.md``, "What is saved"). :meth:`kept` lists held ones as
        ``("weight_grads", stage, micro)``."""

    @abstractmethod
    def stage_backward_weight(self, stage: int, micro: int) -> None:
        """The second half (``W s.m``): form and accumulate the weight gradients held for
        ``(stage, micro)`` by :meth:`stage_backward_input` (or by :meth:`last_stage_step` with
        ``hold_weight_grads``) and free them."""

    @abstractmethod
    def last_stage_step(
        self, stage: int, micro: int, inputs: Tensors, labels: Tensors, hold_weight_grads: bool = False
    ) -> tuple[Any, MaybeTensors]:
        """Forward, loss and backward of the last stage in one call: ``(loss, input gradients)``.
        ``hold_weight_grads``: hold what the weight gradients need for
        :meth:`stage_backward_weight` instead of accumulating them (the split backward)."""

    @abstractmethod
    def set_loss_scale(self, scale: Any) -> None:
        """The upstream gradient of the last stage's loss from the next :meth:`last_stage_step`
        on (a float or a scalar tensor; a graph input, so a new value compiles nothing)."""

    @abstractmethod
    def stage_forward_only(self, stage: int, inputs: Tensors) -> Tensors:
        """Run a stage chunk for evaluation: its outputs, nothing recorded or kept."""

    @abstractmethod
    def last_stage_forward(self, stage: int, inputs: Tensors, labels: Tensors | None) -> Any:
        """The last stage for evaluation, nothing recorded and no gradient touched: its loss
        (a ``(sum, count)`` pair for a per-token loss) with ``labels``, else its outputs."""

    @abstractmethod
    def multiply_grads(self, factor: Any) -> None:
        """Multiply every gradient accumulator in place by ``factor`` (float or scalar tensor)."""

    @abstractmethod
    def grad_norm_part(self, names: Sequence[str], norm_type: float) -> Any:
        """This rank's share of a ``norm_type``-norm over the accumulators of ``names``: a
        float32 scalar tensor (float64 where the host adds in float64), the sum of ``|g| ** p``
        (the largest ``|g|`` for ``inf``)."""

    @abstractmethod
    def unscale_and_check(
        self, factor: float, names: Sequence[str], norm_type: float | None
    ) -> tuple[bool, float]:
        """Multiply every accumulator in place by ``factor``, then return whether none holds an
        infinity or a NaN and this rank's share of a ``norm_type``-norm over the accumulators of
        ``names`` (as :meth:`grad_norm_part`; 0.0 without ``norm_type``): the end of a
        loss-scaled step in one pass over the gradients."""

    @abstractmethod
    def set_aside_grads(self) -> None:
        """Keep a copy of every accumulator and zero them (the step that follows then holds only
        its own gradients, which can be post-processed alone)."""

    @abstractmethod
    def add_back_grads(self) -> None:
        """Add the copy :meth:`set_aside_grads` kept back into every accumulator."""

    @abstractmethod
    def grads(self) -> dict[str, Any]:
        """Accumulated gradients of every parameter this rank trains, by parameter name."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Reset every gradient buffer to zero."""

    @abstractmethod
    def begin_step(self) -> None:
        """A step (a walk of the plan) begins: kernels that adapt to the shapes they see count
        in steps, not calls (every micro-batch of a step calls them with the same shapes)."""

    @abstractmethod
    def kept(self) -> Sequence[Hashable]:
        """The keys whose forward state is still held (for leak checks): ``(stage, micro)`` of
        stage forwards, and the keys of taped preprocess forwards."""

    def held_state(self) -> HeldState:
        """What this executor holds now, for the memory accounting (nothing, unless overridden)."""
        return HeldState()

    @property
    def split_buffer_bytes(self) -> int:
        """Bytes of the split backward's per-shape buffers (probes, stores, call counters) held
        now; bounded by the kernel cache's size (nothing, unless overridden)."""
        return 0

    def release_forward(self, stage: int, micro: int) -> None:
        """Forget the forward kept under ``(stage, micro)`` without touching any gradient (the
        tape calibration's forwards, :mod:`graph_exec.runtime.tape_calibration`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot release a single kept forward")

    @abstractmethod
    def drop_kept(self, consume: bool = True) -> None:
        """Forget every held forward state (abort path and start of a step). ``consume=False``
        forgets it without running anything, for an abort while a communication call that timed
        out may still be running on another thread."""

    @property
    @abstractmethod
    def compile_stats(self) -> CompileStats:
        """Compilation counters, exposed for the benchmarks."""
