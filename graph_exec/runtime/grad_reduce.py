"""``GRADreduce`` with accumulation: all-reduce only what *this* step added.

Gradients accumulate across ``run()`` calls until ``zero_grad()``. With owner backward, every
rank holds part of this step's preprocess gradient, and a SUM all-reduce of the whole buffer
would also multiply the already-reduced gradient of earlier steps by ``P``. So the buffers are
snapshotted when the step starts and only the difference travels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepContribution:
    """Snapshot of accumulating buffers; :meth:`all_reduce` sums only the increment since."""

    def __init__(self, buffers: list[Any]) -> None:
        from mindspore import ops

        self._buffers = buffers
        self._base = [ops.deepcopy(buffer) for buffer in buffers]

    def all_reduce(self, reduce_sum: Callable[[list[Any]], None]) -> None:
        """Replace each buffer by ``snapshot + sum over ranks of (buffer - snapshot)``."""
        from mindspore import ops

        deltas = [buffer - base for buffer, base in zip(self._buffers, self._base, strict=True)]
        reduce_sum(deltas)
        for buffer, base, delta in zip(self._buffers, self._base, deltas, strict=True):
            ops.assign(buffer, base + delta)
