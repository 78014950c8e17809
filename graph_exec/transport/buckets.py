"""Bucketed all-reduce: average many gradient tensors over a group in a few large calls.

One collective per parameter pays the per-call latency (≈0.3 ms on loopback here, far more
across hosts) once per parameter; a model has hundreds. So the tensors are packed, in a fixed
order, into flat buckets of at most ``bucket_bytes`` (one dtype per bucket; a tensor larger
than a bucket gets a bucket of its own), each bucket is all-reduced once, and the averages are
copied back in place. Every rank of the group must hand in tensors of the same names, shapes
and dtypes in the same order (the schedules check that in their set-up handshake).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Default bucket size. Averaging 6 MiB over 4 loopback ranks here
#: (``python -m graph_exec.benchmarks.mesh_speed``, shared 2-core machine): one call per tensor
#: 1.4 s, 1 MiB buckets 0.48 s, 4 MiB 0.27 s, 16 MiB 0.26 s (medians). Beyond 4 MiB the gain is
#: within the noise, while every bucket costs a flat copy of its size.
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Positions (in the caller's tensor list) of the tensors packed into one flat buffer."""

    indices: tuple[int, ...]
    nbytes: int


def plan_buckets(sizes: Sequence[tuple[int, str]], bucket_bytes: int) -> list[Bucket]:
    """Group tensors ``(nbytes, dtype name)``, in order, into buckets of one dtype each.

    A bucket is closed when the next tensor would overflow ``bucket_bytes`` or has another
    dtype; a tensor larger than ``bucket_bytes`` is a bucket by itself. Pure: no MindSpore.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    current: list[int] = []
    size, dtype = 0, None
    for index, (nbytes, name) in enumerate(sizes):
        if current and (name != dtype or size + nbytes > bucket_bytes):
            buckets.append(Bucket(tuple(current), size))
            current, size = [], 0
        current.append(index)
        size += nbytes
        dtype = name
    if current:
        buckets.append(Bucket(tuple(current), size))
    return buckets


class BucketedAverage:
    """Averages a fixed list of tensors (e.g. gradient accumulators) over a transport's group.

    ``tensors`` must be writable in place with ``ops.assign`` (``Parameter`` accumulators).
    """

    def __init__(self, tensors: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.tensors = list(tensors)
        self.buckets = plan_buckets([(int(t.nbytes), str(t.dtype)) for t in self.tensors], bucket_bytes)

    def __call__(self, transport: Any) -> None:
        """Replace every tensor with its mean over ``transport``'s group (one all-reduce per bucket)."""
        if transport is None or transport.size == 1 or not self.tensors:
            return
        from mindspore import ops

        flats = [ops.cat([self.tensors[i].reshape(-1) for i in bucket.indices]) for bucket in self.buckets]
        transport.all_reduce_sum(flats)
        scale = 1.0 / transport.size
        for bucket, flat in zip(self.buckets, flats, strict=True):
            mean = flat * scale
            offset = 0
            for i in bucket.indices:
                tensor = self.tensors[i]
                count = int(tensor.size)
                ops.assign(tensor, mean[offset : offset + count].reshape(tensor.shape))
                offset += count
