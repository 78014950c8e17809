"""The pynative executor: the very same kernels, called eagerly.

Nothing is compiled, so a breakpoint inside a kernel or inside the user's ``construct`` stops
on every call and every intermediate tensor can be inspected. The forward runs eagerly under
the same autograd tape as in graph mode, and the backward replays the recorded ops. Numbers match the graph
executor because both call the kernels made by ``graph_exec.kernels`` with the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import CompileStats
from .kernel_executor import KernelExecutor


class PynativeExecutor(KernelExecutor):
    """Hooks whose kernels run op by op in PyNative mode."""

    mode = "pynative"

    def _prepare(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        return kernel

    @property
    def compile_stats(self) -> CompileStats:
        kernels = self._kernels
        return CompileStats(
            cached_kernels=len(kernels), evictions=kernels.evictions, cached_bytes=kernels.nbytes()
        )
