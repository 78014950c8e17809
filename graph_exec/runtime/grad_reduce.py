"""``GRADreduce`` with accumulation: all-reduce only what *this* step added.

Gradients accumulate across ``run()`` calls until ``zero_grad()``. With owner backward, every
rank holds part of this step's preprocess gradient, and a SUM all-reduce of the whole buffer
would also multiply the already-reduced gradient of earlier steps by ``P``. So the buffers are
snapshotted when the step starts and only the difference travels, in flat buckets
(:class:`~graph_exec.transport.buckets.PackedTensors`: one collective per bucket, not per
parameter).
"""

from __future__ import annotations

from typing import Any

from graph_exec.transport.buckets import PackedTensors


class StepContribution:
    """Snapshot of accumulating buffers; :meth:`all_reduce` sums only the increment since."""

    def __init__(self, buffers: PackedTensors) -> None:
        self._buffers = buffers
        self._base = buffers.snapshot()

    def all_reduce(self, transport: Any) -> None:
        """Replace each buffer by ``snapshot + sum over ranks of (buffer - snapshot)``."""
        self._buffers.sum_increments(transport, self._base)
