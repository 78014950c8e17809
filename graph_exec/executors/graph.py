"""The graph executor: every kernel compiled with ``mindspore.jit``, one graph per signature.

A stage forward is the compiled chunk called under MindSpore's autograd tape: MindSpore then
compiles a forward graph that also returns what the backward needs and a bprop graph that
consumes it, so the backward recomputes nothing (see ``tape``).

A kernel is made and compiled the first time its hook sees a new signature (input shapes and
dtypes, which outputs carry a cotangent, constant keyword values) and the compiled callable is
reused for every later call with that signature. Compiling costs far more than a call
(hundreds of milliseconds to seconds against milliseconds), so :attr:`compile_stats` counts
compilations and their seconds for the benchmarks and for spotting shape churn.

A compiled graph holds on to the storage its parameters had when it was compiled, so a
``Parameter.set_data`` would leave it reading old values: before every call this executor
compares a token of the parameters that call's kernel reads (its stage's, the preprocess's, or all
of them) with the one it last saw and drops all compiled kernels when it changed; they recompile
on next use and are counted (:mod:`graph_exec.executors.storage` says how the token is taken on
each device). Checking only the kernel's own parameters keeps the check at a few microseconds
per call (checking all of them took ~5 % of the profiled time of a single-process ``embed_lm``
step, by cProfile).

``MS_JIT=0`` in the environment turns ``mindspore.jit`` off: the same kernels then run eagerly
(the counters still count first calls per signature).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any

from graph_exec.device import policy

from .base import CompileStats
from .dynamic_kernel import GeneralisingKernel
from .jit_options import compile_function
from .kernel_executor import KernelExecutor
from .storage import storage_token

#: Process-wide numbering of made kernels (several executors may live in one process).
_kernel_numbers = itertools.count()
#: Watch groups besides the stage indices.
_PREPROCESS, _EVERYTHING = "preprocess", "everything"


def _watch_group(key: Hashable) -> Hashable:
    """Whose parameters the kernel cached under ``key`` reads: its stage (keys
    ``("stage_...", stage, ...)`` / ``("loss_...", stage, ...)``), the preprocess, or everything."""
    kind = key[0]
    if kind.startswith(("stage", "loss")):
        return key[1]
    if kind.startswith("preprocess"):
        return _PREPROCESS
    return _EVERYTHING


class GraphExecutor(KernelExecutor):
    """Hooks whose kernels run as compiled MindSpore graphs."""

    mode = "graph"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stats = CompileStats()
        self._mindspore_start = mindspore_compilations() or 0
        # The parameters each kind of kernel reads or writes (frozen ones included): a stage's
        # kernels its stage's, the preprocess kernels the preprocess's, the others (zero_grad)
        # every parameter and accumulator.
        cells: dict[Hashable, Any] = dict(self._stages)
        if self._preprocess is not None:
            cells[_PREPROCESS] = self._preprocess
        self._watched = {group: tuple(cell.get_parameters()) for group, cell in cells.items()}
        every = {id(p): p for params in self._watched.values() for p in params}
        every.update({id(p): p for p in self._buffers.values()})
        self._watched[_EVERYTHING] = tuple(every.values())
        self._token = storage_token(policy().storage_by_address)
        self._storage = {group: self._token(params) for group, params in self._watched.items()}

    def _cached(self, key: Hashable) -> Any:
        group = _watch_group(key)
        if self._token(self._watched[group]) != self._storage[group]:
            self._forget_kernels()  # kept forwards hold their own tapes and finish on them
            self._storage = {g: self._token(params) for g, params in self._watched.items()}
        return super()._cached(key)

    def _prepare(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        # Each made kernel is its own closure (per cell and signature) and compiles once. jit
        # keys functions by module, name, file and line, so a second closure of the same maker
        # would log "has been compiled again" although nothing is compiled twice: number them.
        kernel.__name__ = kernel.__qualname__ = f"{kernel.__name__}_{next(_kernel_numbers)}"
        # The default "ast" capture: "trace" replays stale gradients (see shared design notes).
        # Dynamic shapes: a static graph for the first shape, one dynamic graph for the rest.
        if self.dynamic_shapes:
            return GeneralisingKernel(kernel, lambda: self.steps_begun, self.jit_options)
        return compile_function(kernel, self.jit_options)

    def _on_new_kernel(self, first_call_seconds: float) -> None:
        # The first call compiles and then runs once; the run is small next to the compile.
        self._stats.compilations += 1
        self._stats.compile_seconds += first_call_seconds

    @property
    def compile_stats(self) -> CompileStats:
        """The live counters (``compilations`` and ``compile_seconds`` keep counting in a held
        reference; the cache and MindSpore's count are brought up to date here)."""
        now = mindspore_compilations()
        self._stats.mindspore_compilations = None if now is None else now - self._mindspore_start
        self._stats.cached_kernels = len(self._kernels)
        self._stats.evictions = self._kernels.evictions
        self._stats.cached_bytes = self._kernels.nbytes()
        return self._stats


def mindspore_compilations() -> int | None:
    """How many ``mindspore.jit`` graphs MindSpore compiled in this process, or ``None``.

    MindSpore 2.10 adds the phase of every graph its jit compiles to the module-level set
    ``mindspore.graph.api.ms_compile_cache`` (a new shape of a cached jit function is a new
    phase; nothing is removed but by ``mindspore.ms_memory_recycle``), so its size counts
    compilations for the price of a ``len``. A private name: where it is missing the count is
    ``None``. The bprop graphs MindSpore builds for a jitted forward run under the autograd
    tape do not go through it.
    """
    try:
        from mindspore.graph import api
    except ImportError:
        return None
    cache = getattr(api, "ms_compile_cache", None)
    return len(cache) if isinstance(cache, set) else None
