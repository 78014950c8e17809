"""Data frames: one message per transfer, with its check carried in band (pure numpy).

A transfer's tensors travel as one *frame*: a 64-byte prefix, then each tensor's bytes at a
64-byte aligned offset. The prefix says what the frame is — kind and epoch, the pair's sequence
number, the frame's size, a digest of its layout and the sender's step label — so the receiver
can refuse a frame it did not expect instead of handing on wrong bytes, with no header message
in front. Both sides derive the same :class:`FrameLayout` from the header that announced the
layout (see :mod:`graph_exec.transport.meta`), so the receiver knows the size to receive.

Why the receiver can trust the check: MindSpore's CPU backend keeps message boundaries, delivers
a message into a larger buffer (the rest is left as it was) and fails a receive whose buffer is
too small while still consuming that message (measured with MindSpore 2.10). A frame is read
from its first word, and the size in its prefix tells how much of the buffer it filled.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np

from graph_exec.transport.meta import (
    LABEL_WORDS,
    GroupMeta,
    TensorMeta,
    encode_entries,
    first_word,
    split_first_word,
    unpack_text,
)

DATA = 0x47455844  # "GEXD"
#: Frame prefix length in int64 words (kind|epoch, seq, frame bytes, layout digest, label).
PREFIX_WORDS = 4 + LABEL_WORDS
PREFIX_BYTES = PREFIX_WORDS * 8
#: Where the sequence number and the label start in a prefix (in words).
SEQ_WORD, LABEL_START = 1, 4
#: Alignment of every tensor inside a frame (a frame itself starts 64-byte aligned).
ALIGNMENT = 64
#: How each dtype is stored in a frame (numpy has no bfloat16: its bits travel as uint16).
STORAGE = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


#: Where one tensor sits in a frame: byte offset, byte size, storage dtype, shape.
Slot = tuple[int, int, np.dtype, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class FrameLayout:
    """Where each tensor of a transfer sits in its frame (``None`` entries take no bytes).

    Made by :func:`layout_of`, which returns one shared object per distinct ``entries``: layouts
    compare and hash by identity (cheap on every send) and equal layouts share staging memory.
    """

    entries: tuple[TensorMeta | None, ...]
    slots: tuple[Slot | None, ...]
    nbytes: int
    digest: int

    def views(self, frame: np.ndarray) -> tuple[np.ndarray | None, ...]:
        """Each tensor's storage in ``frame`` (a uint8 array of at least :attr:`nbytes`), no copy."""
        return tuple(
            None if slot is None else np.ndarray(slot[3], slot[2], buffer=frame, offset=slot[0])
            for slot in self.slots
        )


@functools.lru_cache(maxsize=4096)
def layout_of(entries: tuple[TensorMeta | None, ...]) -> FrameLayout:
    """The layout of ``entries``; raises ``ValueError`` for what a header cannot describe."""
    encoded = encode_entries(GroupMeta("", entries))
    slots: list[Slot | None] = []
    end = PREFIX_BYTES
    for entry in entries:
        if entry is None:
            slots.append(None)
            continue
        storage = STORAGE[entry.dtype]
        start = _aligned(end)
        end = start + entry.numel * storage.itemsize
        slots.append((start, end - start, storage, entry.shape))
    return FrameLayout(entries, tuple(slots), end, zlib.crc32(encoded.tobytes()))


@dataclass(frozen=True)
class Prefix:
    """A frame's prefix as received."""

    kind: int
    epoch: int
    seq: int
    nbytes: int
    digest: int
    label: str


def prefix_words(layout: FrameLayout, label_words: list[int], epoch: int, seq: int) -> list[int]:
    """The :data:`PREFIX_WORDS` words that start a frame of ``layout`` (what a receiver compares
    a frame's prefix with)."""
    return [first_word(DATA, epoch), seq, layout.nbytes, layout.digest, *label_words]


def write_prefix(
    words: np.ndarray, layout: FrameLayout, label_words: list[int], epoch: int, seq: int
) -> None:
    """Fill the :data:`PREFIX_WORDS` int64 ``words`` at the start of a frame."""
    words[:] = prefix_words(layout, label_words, epoch, seq)


def read_prefix(frame: np.ndarray) -> Prefix:
    """The prefix of ``frame`` (a uint8 array of at least :data:`PREFIX_BYTES`)."""
    return prefix_from_words(frame[:PREFIX_BYTES].view(np.int64).tolist())


def prefix_from_words(words: list[int]) -> Prefix:
    """The prefix whose :data:`PREFIX_WORDS` int64 words are ``words``."""
    kind, epoch = split_first_word(words[0])
    label = unpack_text(np.array(words[LABEL_START:PREFIX_WORDS], dtype=np.int64))
    return Prefix(kind, epoch, int(words[SEQ_WORD]), int(words[2]), int(words[3]), label)
