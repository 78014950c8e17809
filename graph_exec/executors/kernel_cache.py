"""A bounded cache of made kernels: least recently used first out, evictions counted.

The executors make one kernel per signature (input shapes and dtypes, which outputs carry a
cotangent, constant keyword values) and keep it for every later call with that signature. With
shapes that change from step to step an unbounded cache grows without end, one compiled graph
per shape; this one holds at most ``size`` kernels and drops the one used longest ago.

An evicted kernel is only forgotten by the executor: a kept forward holds its own tape and
finishes on it, and a signature seen again is made (and compiled) anew and counted again.
MindSpore 2.10 itself keeps the compiled graph of every ``mindspore.jit`` phase in its graph
executor until ``mindspore.ms_memory_recycle()``; the cache bounds what the library holds and
how often it makes kernels, not MindSpore's own memory (see ``docs/shapes.md``).

Some entries hold tensors made for their signature (the split backward's probes and stores are
shaped like the layers' inputs and outputs); an entry that says its ``nbytes`` is counted by
:meth:`KernelCache.nbytes`, which ``stats()["memory"]["caches"]["kernels"]`` shows. The bound
is on entries: those tensors go with their entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from graph_exec import checks

from .errors import ExecutorConfigError

#: Kernels an executor keeps by default. One static shape needs about a dozen per rank (stage
#: forward and backward per chunk, the loss step, the preprocess forward and backward, the
#: gradient kernels); 256 leaves room for several buckets on a rank of several chunks.
DEFAULT_KERNEL_CACHE_SIZE = 256


class KernelCache:
    """``key -> kernel``, at most ``size`` entries, least recently used evicted first."""

    def __init__(self, size: int = DEFAULT_KERNEL_CACHE_SIZE) -> None:
        self.size = checks.positive_int("kernel_cache_size", size, ExecutorConfigError)
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        #: Kernels dropped because the cache was full (not those of :meth:`clear`).
        self.evictions = 0

    def get(self, key: Hashable) -> Any:
        """The kernel under ``key`` (now the most recently used), or ``None``."""
        kernel = self._entries.get(key)
        if kernel is not None:
            self._entries.move_to_end(key)
        return kernel

    def put(self, key: Hashable, kernel: Any) -> Any:
        """Keep ``kernel`` under ``key`` as the most recently used; evict beyond ``size``."""
        self._entries[key] = kernel
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
            self.evictions += 1
        return kernel

    def __getitem__(self, key: Hashable) -> Any:
        return self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of the tensors the kept entries hold, where an entry says them (``nbytes``);
        read when asked (at most ``size`` entries), so a hit costs nothing more."""
        return sum(int(getattr(kernel, "nbytes", 0)) for kernel in self._entries.values())

    def clear(self) -> None:
        """Forget every kernel (a parameter's storage moved); not counted as evictions."""
        self._entries.clear()
