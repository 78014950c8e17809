"""Data parallelism across pipeline replicas: same start, averaged gradients after each step.

Every replica trains the same model on its own share of the global batch. Two things keep the
replicas one model:

- at set-up, every trainable parameter of this rank is overwritten with the values of the same
  pipeline rank in replica 0 (as DDP does), so replicas built from different seeds or loaded
  at different moments still start equal;
- after every ``run()``, the accumulated gradient of every parameter this rank trains (its
  stages, and the preprocess where this rank trains it) is replaced by its mean over the
  data-parallel group, in a few flat buckets (:mod:`graph_exec.transport.buckets`).

Averaging the whole accumulator (not just this step's increment) is exact under gradient
accumulation: whatever was accumulated before is already equal on every replica, and the mean
of equal values is that value. So ``grads()`` always holds the mean over replicas, and with
``scale_grads=True`` it is the gradient of the mean loss over all micro-batches of all replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graph_exec.transport.buckets import PackedTensors


@dataclass
class DataParallelStats:
    """Counters of the gradient averaging on this rank."""

    steps: int = 0
    buckets: int = 0  #: buckets per step
    bytes: int = 0  #: gradient bytes averaged per step
    seconds: float = 0.0  #: total time spent averaging (all steps)


class DataParallelGrads:
    """Keeps one rank's parameters and gradients in step with its data-parallel peers.

    ``transport``: the data-parallel group's transport. ``params``: what this rank trains, in
    the same order on every replica (checked by the set-up handshake). ``accumulators``: returns
    their gradient buffers in that order.
    """

    def __init__(
        self,
        transport: Any,
        params: Sequence[Any],
        accumulators: Callable[[], list[Any]],
        bucket_bytes: int,
    ) -> None:
        self.transport = transport
        self.params = PackedTensors(params, bucket_bytes)
        self._grads = PackedTensors(accumulators(), bucket_bytes)
        self.stats = DataParallelStats(
            buckets=len(self._grads.buckets), bytes=sum(b.nbytes for b in self._grads.buckets)
        )

    def start_in_sync(self) -> None:
        """Give every replica replica 0's parameter values (once, at set-up)."""
        self.params.broadcast(self.transport, src=0)

    def average(self) -> None:
        """Replace every gradient accumulator with its mean over the replicas."""
        start = time.perf_counter()
        self._grads.average(self.transport)
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - start
