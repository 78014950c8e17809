"""Control messages of the pipeline protocol: headers, abort notices, hellos (pure numpy).

Messages on MindSpore's CPU backend match by order only: tags are ignored and a mismatched
sequence silently delivers the wrong bytes. Every message therefore says what it is in its
first word (a kind magic in the high 32 bits, the transport's *epoch* in the low 32 bits), and
the receiver checks it before trusting the rest. Data travels in frames
(:mod:`graph_exec.transport.frames`); the messages here are the fixed-size (1 KiB) control
messages around them:

- a *header* announces the dtypes and shapes of a transfer. It is sent only when a pair's
  transfer under a label changes layout (its first time, or a new shape); after that both sides
  know the layout and the data frame goes alone. A group's entries keep their positions: a
  ``None`` entry (an input that takes no gradient) stays ``None``;
- an *abort notice*: a rank that fails tells its peers why, and a peer blocked on a receive from
  it reports that instead of waiting for a timeout;
- a *hello*: a transport that replaces an earlier one on the same ranks (a restart after a
  failed step) exchanges hellos, skipping whatever the failed step left in the channel.

A receive buffer is never smaller than :data:`CONTROL_BYTES`, so any control message fits
wherever a frame was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Control message length in int64 words (1 KiB).
META_WORDS = 128
#: Control message length in bytes: the smallest receive buffer.
CONTROL_BYTES = META_WORDS * 8
HEADER = 0x47455832  # "GEX2"
ABORT = 0x47455821  # "GEX!"
HELLO = 0x47455848  # "GEXH"
#: Largest epoch a message can carry (the low 32 bits of its first word).
MAX_EPOCH = (1 << 32) - 1
LABEL_WORDS = 4  # 32 bytes of label
_HEAD_WORDS = 3 + LABEL_WORDS  # kind|epoch, sequence number, entry count, label
#: Tensor dtypes a transfer can carry; the header stores ``index + 1`` (0 means ``None``).
DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)


@dataclass(frozen=True)
class TensorMeta:
    """dtype name (one of :data:`DTYPE_NAMES`) and shape of one payload tensor."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class GroupMeta:
    """What a transfer carries: the sender's step label and one entry per tensor."""

    label: str
    entries: tuple[TensorMeta | None, ...]


@dataclass(frozen=True)
class Header:
    """A header as received: the sender's epoch, the transfer's sequence number and its layout."""

    epoch: int
    seq: int
    meta: GroupMeta


@dataclass(frozen=True)
class AbortNotice:
    """A peer's failure report, received where a transfer was expected."""

    epoch: int
    text: str


@dataclass(frozen=True)
class Hello:
    """A restarted peer's first message (see the module doc)."""

    epoch: int


def first_word(kind: int, epoch: int) -> int:
    """The first word of every message: kind magic and epoch."""
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch} is outside [0, {MAX_EPOCH}]")
    return (kind << 32) | epoch


def split_first_word(word: int) -> tuple[int, int]:
    """``(kind, epoch)`` of a message's first word."""
    word = int(word)
    return (word >> 32) & 0xFFFFFFFF, word & 0xFFFFFFFF


def pack_text(text: str, words: int) -> np.ndarray:
    """``text`` as UTF-8 in ``words`` int64 words (truncated, zero padded)."""
    raw = text.encode("utf-8")[: words * 8]
    return np.frombuffer(raw.ljust(words * 8, b"\0"), dtype=np.int64)


def unpack_text(words: np.ndarray) -> str:
    return words.tobytes().rstrip(b"\0").decode("utf-8", errors="replace")


def pack_label(label: str) -> np.ndarray:
    """The label words of a header or frame; raises ``ValueError`` if it does not fit."""
    if len(label.encode("utf-8")) > LABEL_WORDS * 8:
        raise ValueError(f"transfer label {label!r} is longer than {LABEL_WORDS * 8} bytes")
    return pack_text(label, LABEL_WORDS)


def encode_entries(meta: GroupMeta) -> np.ndarray:
    """The entry words of ``meta`` (dtype code, rank, dims per tensor; 0 for ``None``)."""
    words: list[int] = []
    for entry in meta.entries:
        if entry is None:
            words.append(0)
            continue
        if entry.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {entry.dtype!r} cannot be sent; supported: {', '.join(DTYPE_NAMES)}")
        words.extend((DTYPE_NAMES.index(entry.dtype) + 1, len(entry.shape), *entry.shape))
    if len(words) > META_WORDS - _HEAD_WORDS:
        raise ValueError(
            f"transfer {meta.label!r} has too many tensors or dimensions for one header "
            f"({len(meta.entries)} tensors; at most {META_WORDS - _HEAD_WORDS} header words)"
        )
    return np.array(words, dtype=np.int64)


def encode_header(meta: GroupMeta, epoch: int, seq: int) -> np.ndarray:
    """The words of a header announcing ``meta``; raises ``ValueError`` if it does not fit."""
    words = np.zeros(META_WORDS, dtype=np.int64)
    entries = encode_entries(meta)
    words[0], words[1], words[2] = first_word(HEADER, epoch), seq, len(meta.entries)
    words[3:_HEAD_WORDS] = pack_label(meta.label)
    words[_HEAD_WORDS : _HEAD_WORDS + len(entries)] = entries
    return words


def encode_abort(text: str, epoch: int) -> np.ndarray:
    """The words of an abort notice carrying ``text`` (truncated to fit)."""
    words = np.zeros(META_WORDS, dtype=np.int64)
    words[0] = first_word(ABORT, epoch)
    words[1:] = pack_text(text, META_WORDS - 1)
    return words


def encode_hello(epoch: int) -> np.ndarray:
    """The words of a hello from a transport of ``epoch``."""
    words = np.zeros(META_WORDS, dtype=np.int64)
    words[0] = first_word(HELLO, epoch)
    return words


def decode(words: np.ndarray) -> Header | AbortNotice | Hello:
    """Parse a control message; raises ``ValueError`` for anything else."""
    if words.shape != (META_WORDS,) or words.dtype != np.int64:
        raise ValueError(
            f"a control message is {META_WORDS} int64 words, got {words.dtype}{list(words.shape)}"
        )
    kind, epoch = split_first_word(words[0])
    if kind == ABORT:
        return AbortNotice(epoch, unpack_text(words[1:]))
    if kind == HELLO:
        return Hello(epoch)
    if kind != HEADER:
        raise ValueError(
            f"not a control message (first word {int(words[0]):#x}); the message order is broken"
        )
    seq, count, label = int(words[1]), int(words[2]), unpack_text(words[3:_HEAD_WORDS])
    entries: list[TensorMeta | None] = []
    pos = _HEAD_WORDS
    for _ in range(count):
        code = int(words[pos])
        if code == 0:
            entries.append(None)
            pos += 1
            continue
        ndim = int(words[pos + 1])
        shape = tuple(int(d) for d in words[pos + 2 : pos + 2 + ndim])
        entries.append(TensorMeta(DTYPE_NAMES[code - 1], shape))
        pos += 2 + ndim
    return Header(epoch, seq, GroupMeta(label, tuple(entries)))
