"""Where a data frame lives: host memory (the CPU fast path) or MindSpore tensors (every device).

A frame (:mod:`graph_exec.transport.frames`) is one message: a prefix, then each tensor's bytes
at a 64-byte aligned offset, padded to at least :data:`~graph_exec.transport.meta.CONTROL_BYTES`
so that a sender and its receiver always name the same message size (NCCL and HCCL match a
point-to-point message by its byte count; MindSpore's CPU back end would also accept a larger
receive buffer). The transport builds, receives and reads frames through one of two
realisations, chosen by :attr:`~graph_exec.device.DevicePolicy.host_memory_aliasing`:

- :class:`HostFrames` (CPU fast path): a frame is a uint8 numpy array; MindSpore sends from and
  receives into a ``from_numpy`` tensor sharing its memory, and the received prefix and tensors
  are read through numpy views. A send copies each tensor into a reused staging frame, by address
  where the tensor is contiguous.
- :class:`TensorFrames` (device path): a frame is a uint8 MindSpore tensor. A send concatenates
  the prefix and the tensors' bytes with MindSpore ops (no round trip through the host); a
  received frame is read only through the tensor (``asnumpy`` of its prefix, which waits for the
  receive), and its tensors are slices of it.

Bounds: the host staging frames are kept per exact layout, so shapes that change from step to
step would keep one set per shape for the whole run; the idle ones are an
:class:`~graph_exec.idle_buffers.IdleBuffers` of at most ``cache_bytes`` (least recently used
freed first). A staging frame is idle only once its send has completed (:meth:`HostFrames.reuse`),
so no in-flight send loses its memory. The device path stages nothing; its padding tensors are
kept per byte count, which is below :data:`~graph_exec.transport.meta.CONTROL_BYTES`: at most
that many, a few KiB in all.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graph_exec import checks
from graph_exec.idle_buffers import DEFAULT_BUFFER_CACHE_BYTES, IdleBuffers
from graph_exec.transport.frames import LABEL_START, PREFIX_BYTES, SEQ_WORD, FrameLayout, write_prefix
from graph_exec.transport.meta import CONTROL_BYTES, LABEL_WORDS

#: Gives the memory of one incoming message of exactly ``nbytes`` bytes (a uint8 numpy array,
#: 64-byte aligned, on the host path; a uint8 MindSpore tensor on the device path) that stays
#: reserved while the received tensors are in use. The runtime passes pool-backed ones.
Allocator = Callable[[int], Any]


#: The most the device path's padding tensors can hold: one per size, every size below a control
#: message's (a gap before an aligned tensor is under 64 bytes, the tail pads up to
#: ``CONTROL_BYTES``), so nothing needs evicting.
PAD_BOUND_BYTES = CONTROL_BYTES * (CONTROL_BYTES - 1) // 2


def message_bytes(layout: FrameLayout) -> int:
    """The size of the message that carries a frame of ``layout`` (never below a control message)."""
    return max(layout.nbytes, CONTROL_BYTES)


def numpy_allocator(nbytes: int) -> np.ndarray:
    """Fresh 64-byte aligned host memory for one message (where no buffer pool is wired in)."""
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes]


def tensor_allocator(nbytes: int) -> Any:
    """A fresh uint8 MindSpore tensor for one message (where no receive slots are wired in)."""
    import mindspore as ms
    from mindspore import ops

    return ops.zeros((nbytes,), ms.uint8)


class _Staging:
    """A reusable host send frame of one layout: its memory, tensor, prefix words and tensor slots.

    The prefix's kind, epoch and layout words are written once; :meth:`stamp` rewrites the
    label only when it changed since the last send from this frame, and the sequence number.
    """

    __slots__ = ("addresses", "frame", "label", "layout", "prefix", "slots", "tensor")

    def __init__(self, layout: FrameLayout, epoch: int) -> None:
        import mindspore as ms

        self.layout = layout
        self.frame = numpy_allocator(message_bytes(layout))
        self.prefix = self.frame[:PREFIX_BYTES].view(np.int64)
        write_prefix(self.prefix, layout, [0] * LABEL_WORDS, epoch, 0)
        self.label: str | None = None
        self.slots = tuple(v if v is None or v.size else None for v in layout.views(self.frame))
        self.addresses = tuple(None if v is None else v.ctypes.data for v in self.slots)
        self.tensor = ms.from_numpy(self.frame)

    def stamp(self, label: str, label_words: list[int], seq: int) -> None:
        """Make the prefix say transfer ``seq`` under ``label``."""
        if label != self.label:
            self.prefix[LABEL_START:] = label_words
            self.label = label
        self.prefix[SEQ_WORD] = seq

    def fill(self, tensors: Sequence[Any | None]) -> None:
        """Copy ``tensors`` (of this frame's layout) into their slots (bfloat16 bits travel as
        uint16): a contiguous tensor from its ``data_ptr()``, which on CPU is its host memory and
        waits for the op that makes it; any other through ``asnumpy``."""
        for slot, address, tensor in zip(self.slots, self.addresses, tensors, strict=True):
            if slot is None:
                continue
            if tensor.is_contiguous():
                ctypes.memmove(address, tensor.data_ptr(), slot.nbytes)
                continue
            values = tensor.asnumpy()
            np.copyto(slot, values if values.dtype == slot.dtype else values.view(slot.dtype))


class HostFrames:
    """Frames in host memory, read and written through numpy (the CPU fast path)."""

    allocate: Allocator = staticmethod(numpy_allocator)

    def __init__(self, epoch: int, cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES) -> None:
        import mindspore as ms

        self._epoch = epoch
        self._from_numpy = ms.from_numpy
        self._bfloat16 = ms.bfloat16
        #: Idle staging frames by layout, at most ``cache_bytes`` (least recently used freed first).
        self.idle: IdleBuffers[_Staging] = IdleBuffers(cache_bytes)

    # -- sending ---------------------------------------------------------------------------

    def compose(
        self, layout: FrameLayout, label: str, label_words: list[int], seq: int, tensors: Sequence[Any | None]
    ) -> tuple[Any, _Staging]:
        """The message tensor of one transfer and the staging frame it was written into (give it
        back with :meth:`reuse` once the send has taken the data)."""
        staging = self.idle.take(layout) or _Staging(layout, self._epoch)
        staging.stamp(label, label_words, seq)
        staging.fill(tensors)
        return staging.tensor, staging

    def reuse(self, staging: _Staging | None) -> None:
        """Take back a staging frame whose send has completed (kept while the bound allows)."""
        if staging is not None:
            self.idle.give(staging.layout, staging, staging.frame.nbytes)

    def cache_stats(self) -> dict[str, Any]:
        """The idle staging frames kept (``IdleBuffers.stats``)."""
        return self.idle.stats()

    def control_tensor(self, words: np.ndarray) -> Any:
        """A control message's tensor (sharing the words' memory, which nothing changes later)."""
        return self._from_numpy(words)

    # -- receiving -------------------------------------------------------------------------

    def target(self, frame: np.ndarray) -> Any:
        """The tensor a receive writes ``frame`` through."""
        return self._from_numpy(frame)

    @staticmethod
    def words(frame: np.ndarray, count: int) -> list[int]:
        """The first ``count`` int64 words of a received ``frame``."""
        return frame[: count * 8].view(np.int64).tolist()

    @staticmethod
    def control(frame: np.ndarray) -> np.ndarray:
        """A received control message's words (a copy)."""
        return frame[:CONTROL_BYTES].view(np.int64).copy()

    def tensors(self, layout: FrameLayout, frame: np.ndarray) -> tuple[Any | None, ...]:
        """The MindSpore tensors of a received ``frame``: views of its memory, no copy."""
        out = []
        for entry, view in zip(layout.entries, layout.views(frame), strict=True):
            if view is None:
                out.append(None)
                continue
            tensor = self._from_numpy(view)
            # bfloat16 travels as uint16 bits (numpy has no bfloat16)
            out.append(tensor.view(self._bfloat16) if entry.dtype == "bfloat16" else tensor)
        return tuple(out)


class TensorFrames:
    """Frames as MindSpore tensors, read only through MindSpore (every device; the CPU device path)."""

    allocate: Allocator = staticmethod(tensor_allocator)

    def __init__(self, epoch: int, cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES) -> None:
        import mindspore as ms
        from mindspore import ops

        checks.non_negative_int("buffer_cache_bytes", cache_bytes)  # nothing is staged to bound
        self._epoch = epoch
        self._ms = ms
        self._cat = ops.cat
        self._zeros = ops.zeros
        self._pads: dict[int, Any] = {}
        self._dtypes: dict[str, Any] = {}

    # -- sending ---------------------------------------------------------------------------

    def compose(
        self, layout: FrameLayout, label: str, label_words: list[int], seq: int, tensors: Sequence[Any | None]
    ) -> tuple[Any, None]:
        """The message tensor of one transfer: prefix, padding and each tensor's bytes, joined by
        one concatenation on the device. Nothing is staged, so nothing is given back."""
        prefix = np.empty(PREFIX_BYTES // 8, np.int64)
        write_prefix(prefix, layout, label_words, self._epoch, seq)
        parts = [self._ms.Tensor(prefix.view(np.uint8))]
        end = PREFIX_BYTES
        for slot, tensor in zip(layout.slots, tensors, strict=True):
            if slot is None or slot[1] == 0:
                continue
            start, nbytes = slot[0], slot[1]
            if start > end:
                parts.append(self._pad(start - end))
            parts.append(self._bytes(tensor))
            end = start + nbytes
        total = message_bytes(layout)
        if total > end:
            parts.append(self._pad(total - end))
        return self._cat(parts), None

    def reuse(self, staging: None) -> None:
        """Nothing to take back: every send has a frame of its own."""

    def cache_stats(self) -> dict[str, Any]:
        """Nothing staged: the padding tensors only, bounded by :data:`PAD_BOUND_BYTES`."""
        return {
            "entries": len(self._pads),
            "bytes": sum(self._pads),
            "max_bytes": PAD_BOUND_BYTES,
            "evictions": 0,
            "evicted_bytes": 0,
        }

    def control_tensor(self, words: np.ndarray) -> Any:
        """A control message's tensor (a copy of the words)."""
        return self._ms.Tensor(words)

    def _bytes(self, tensor: Any) -> Any:
        """``tensor``'s bytes as a flat uint8 tensor."""
        flat = tensor.reshape(-1)
        if tensor.ndim == 0:  # MindSpore 2.10 crashes (segfault) viewing a reshaped 0-d tensor's bytes
            flat = flat.copy()
        return flat.view(self._ms.uint8)

    def _pad(self, nbytes: int) -> Any:
        pad = self._pads.get(nbytes)
        if pad is None:
            pad = self._pads[nbytes] = self._zeros((nbytes,), self._ms.uint8)
        return pad

    # -- receiving -------------------------------------------------------------------------

    @staticmethod
    def target(frame: Any) -> Any:
        """The tensor a receive writes: the frame itself."""
        return frame

    @staticmethod
    def words(frame: Any, count: int) -> list[int]:
        """The first ``count`` int64 words of a received ``frame``, read through the tensor (this
        waits until the receive has written them)."""
        return frame[: count * 8].asnumpy().view(np.int64).tolist()

    @staticmethod
    def control(frame: Any) -> np.ndarray:
        """A received control message's words, read through the tensor."""
        return frame[:CONTROL_BYTES].asnumpy().view(np.int64).copy()

    def tensors(self, layout: FrameLayout, frame: Any) -> tuple[Any | None, ...]:
        """The MindSpore tensors of a received ``frame``: slices of it, viewed as their dtypes."""
        out = []
        for entry, slot in zip(layout.entries, layout.slots, strict=True):
            if slot is None:
                out.append(None)
                continue
            dtype = self._dtype(entry.dtype)
            start, nbytes, _, shape = slot
            if nbytes == 0:
                out.append(self._zeros(shape, dtype))
                continue
            out.append(frame[start : start + nbytes].view(dtype).reshape(shape))
        return tuple(out)

    def _dtype(self, name: str) -> Any:
        dtype = self._dtypes.get(name)
        if dtype is None:
            dtype = self._dtypes[name] = getattr(self._ms, "bool_" if name == "bool" else name)
        return dtype
