"""Which samples a replica reads at each step: pure numpy, the same answer on every rank.

An epoch is one permutation of the source's indices (``numpy.random.default_rng((seed,
epoch))``, or the identity without shuffling). Global step ``k`` of the epoch takes the
``k``-th run of ``batch_size * dp_size`` indices of it and replica ``d`` the ``d``-th
``batch_size`` of those, so the replicas' shards are disjoint and together read every sample of
the epoch once. The ``num_samples mod (batch_size * dp_size)`` indices at the end of the
permutation do not fill a global batch: they are left out of that epoch (other ones in each
epoch when shuffled).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The source indices of ``epoch`` in reading order (int64)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(num_samples).astype(np.int64)


def steps_per_epoch(num_samples: int, batch_size: int, dp_size: int) -> int:
    """Global batches in one epoch."""
    return num_samples // (batch_size * dp_size)


def replica_batch(order: np.ndarray, step: int, batch_size: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """The indices replica ``dp_rank`` reads at ``step`` of the epoch whose order is ``order``."""
    begin = (step * dp_size + dp_rank) * batch_size
    return order[begin : begin + batch_size]


def micro_batch_rows(batch_size: int, micro_batch_num: int, micros: Sequence[int]) -> list[int]:
    """The rows of a replica's batch that belong to ``micros`` (the schedule cuts dim 0 evenly)."""
    per = batch_size // micro_batch_num
    return [row for m in sorted(micros) for row in range(m * per, (m + 1) * per)]
