"""Collectives over many tensors in a few large calls: pack them into flat buckets first.

One collective per tensor pays the per-call latency once per tensor, and a model has hundreds
(on loopback here: summing a 16-tensor, 0.5 MiB vision tower one tensor at a time took 12.5 ms,
as one flat buffer 5.3 ms; broadcasting it 8.6 against 4.9 ms). So :class:`PackedTensors` packs
a fixed list of tensors, in order, into flat buckets of at most ``bucket_bytes`` (one dtype per
bucket; a tensor larger than a bucket gets a bucket of its own), runs one collective per
bucket, and writes the results back in place. Every rank of the group must hand in tensors of
the same shapes and dtypes in the same order (the schedules check that in their set-up
handshake).

On the CPU fast path (:attr:`~graph_exec.device.DevicePolicy.packing_by_address`), float32 and
float64 tensors are packed and unpacked by address and the arithmetic around the collective runs
in numpy: a tensor's ``data_ptr()`` is its host memory there, and writes to it are seen by later
eager ops and compiled graphs (see :mod:`kernels.grad_buffers`, which adds gradients the same
way). Packing the same tower with ``ops.cat`` and writing back with ``ops.assign`` cost more than
the collective itself (``StepContribution`` with eager ops: 22 ms in all). Elsewhere the packing
uses MindSpore ops, and every value stays a MindSpore tensor.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graph_exec.device import assign_in_place, policy, wait_until_run

#: Default bucket size. Averaging 6 MiB over 4 loopback ranks here
#: (``python -m graph_exec.benchmarks.mesh_speed``, idle 2-core machine, packed by address): one
#: call per tensor 262 ms, 1 MiB buckets 161 ms, 4 MiB 152 ms, 16 MiB 142 ms (medians). Beyond
#: 4 MiB the gain is within the noise, while every bucket costs a flat copy of its size.
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


class PackedTensors:
    """A fixed list of tensors that collectives act on in flat buckets, one call per bucket.

    ``tensors`` must be writable in place (``Parameter``: weights, gradient accumulators).
    Values in between are numpy arrays on the CPU path and MindSpore tensors elsewhere; both
    support the ``+``, ``-`` and ``*`` used here, with the same IEEE results.
    """

    def __init__(self, tensors: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        import mindspore as ms

        self.tensors = list(tensors)
        self.buckets = plan_buckets([(int(t.nbytes), str(t.dtype)) for t in self.tensors], bucket_bytes)
        # Packed by address only where numpy's arithmetic is MindSpore's: float32 and float64
        # (numpy has no bfloat16 and adds float16 through float32).
        self._by_address = policy().packing_by_address and all(
            t.dtype in (ms.float32, ms.float64) and t.is_contiguous() for t in self.tensors
        )
        # A broadcast does no arithmetic: other dtypes travel as their bytes, packed by address
        # too (MindSpore 2.10 has no bfloat16 Assign kernel on CPU to unpack them with).
        self._bytes_by_address = (
            policy().packing_by_address
            and not self._by_address
            and all(t.is_contiguous() for t in self.tensors)
        )

    def average(self, transport: Any) -> None:
        """Replace every tensor with its mean over ``transport``'s group."""
        if self._alone(transport):
            return
        values = self._load()
        self._in_place(transport.all_reduce_sum, values)
        scale = 1.0 / transport.size
        self._store([value * scale for value in values])

    def all_reduce_sum(self, transport: Any) -> None:
        """Replace every tensor with its sum over ``transport``'s group."""
        if self._alone(transport):
            return
        values = self._load()
        self._in_place(transport.all_reduce_sum, values)
        self._store(values)

    def broadcast(self, transport: Any, src: int = 0) -> None:
        """Overwrite every tensor with group rank ``src``'s values."""
        if self._alone(transport):
            return
        raw = self._bytes_by_address
        values = self._load(raw)
        self._in_place(lambda flats: transport.broadcast(flats, src=src), values, raw)
        if transport.rank != src:
            self._store(values, raw)

    def snapshot(self) -> list[Any]:
        """The tensors' values now, flat (for :meth:`sum_increments`)."""
        return self._load()

    def sum_increments(self, transport: Any, snapshot: list[Any]) -> None:
        """Make every tensor ``snapshot + sum over ranks of (tensor - snapshot)``: a SUM over the
        group of what each rank added since :meth:`snapshot`, leaving what was there before
        (already equal on every rank) counted once."""
        if self._alone(transport):
            return
        increments = [now - before for now, before in zip(self._load(), snapshot, strict=True)]
        self._in_place(transport.all_reduce_sum, increments)
        self._store([before + added for before, added in zip(snapshot, increments, strict=True)])

    def _alone(self, transport: Any) -> bool:
        return transport is None or transport.size == 1 or not self.tensors

    def _load(self, raw: bool = False) -> list[Any]:
        """A fresh flat copy of each bucket's tensors (``raw``: as uint8 bytes, by address)."""
        if not (self._by_address or raw):
            from mindspore import ops

            return [ops.cat([self.tensors[i].reshape(-1) for i in b.indices]) for b in self.buckets]
        import mindspore as ms

        wait_until_run()  # no queued op may still read or write that memory
        flats = []
        for bucket in self.buckets:
            flat = np.empty(bucket.nbytes, np.uint8)
            offset = 0
            for i in bucket.indices:
                tensor = self.tensors[i]
                ctypes.memmove(flat.ctypes.data + offset, tensor.data_ptr(), int(tensor.nbytes))
                offset += int(tensor.nbytes)
            flats.append(
                flat if raw else flat.view(ms.dtype_to_nptype(self.tensors[bucket.indices[0]].dtype))
            )
        return flats

    def _store(self, flats: list[Any], raw: bool = False) -> None:
        """Write each bucket's flat values (``raw``: bytes) back into its tensors."""
        if not (self._by_address or raw):
            for bucket, flat in zip(self.buckets, flats, strict=True):
                offset = 0
                for i in bucket.indices:
                    tensor = self.tensors[i]
                    count = int(tensor.size)
                    assign_in_place(tensor, flat[offset : offset + count].reshape(tensor.shape))
                    offset += count
            return
        wait_until_run()  # no queued op may still read or write that memory
        for bucket, flat in zip(self.buckets, flats, strict=True):
            flat = np.ascontiguousarray(flat)
            offset = 0
            for i in bucket.indices:
                tensor = self.tensors[i]
                ctypes.memmove(tensor.data_ptr(), flat.ctypes.data + offset, int(tensor.nbytes))
                offset += int(tensor.nbytes)

    def _in_place(
        self, collective: Callable[[list[Any]], None], values: list[Any], raw: bool = False
    ) -> None:
        """Run ``collective`` on ``values`` in place (numpy values through tensors sharing their
        memory)."""
        if not (self._by_address or raw):
            collective(values)
            return
        import mindspore as ms

        collective([ms.from_numpy(value) for value in values])
