"""The fixed-size header that precedes every transfer (pure numpy, no MindSpore).

Messages on MindSpore's CPU backend match by order only: tags are ignored and a mismatched
sequence silently delivers the wrong bytes. So every transfer starts with one header that
says what follows — the sender's step label, and per tensor its dtype and shape — and the
receiver checks the label against the step it expects before touching the payload. Shapes
travel with every transfer, so dynamic shapes need no side agreement. A group's entries
keep their positions: a ``None`` entry (an input that takes no gradient) stays ``None``.

The same header slot carries an *abort notice*: a rank that fails tells its peers why, and a
peer blocked on a receive from it reports that instead of waiting for a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Header length in int64 words (1 KiB): one small message per transfer.
META_WORDS = 128
_MAGIC = 0x47455831  # "GEX1"
_ABORT = 0x47455821  # "GEX!"
_LABEL_WORDS = 4  # 32 bytes of label
_HEAD_WORDS = 2 + _LABEL_WORDS  # magic, entry count, label
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
    """The header of one transfer: the sender's step label and one entry per tensor."""

    label: str
    entries: tuple[TensorMeta | None, ...]


@dataclass(frozen=True)
class AbortNotice:
    """A peer's failure report, received where a transfer header was expected."""

    text: str


def _pack_text(text: str, words: int) -> np.ndarray:
    raw = text.encode("utf-8")[: words * 8]
    return np.frombuffer(raw.ljust(words * 8, b"\0"), dtype=np.int64)


def _unpack_text(words: np.ndarray) -> str:
    return words.tobytes().rstrip(b"\0").decode("utf-8", errors="replace")


def encode_group(meta: GroupMeta) -> np.ndarray:
    """The header words for ``meta``; raises ``ValueError`` if it does not fit the header."""
    words = np.zeros(META_WORDS, dtype=np.int64)
    words[0], words[1] = _MAGIC, len(meta.entries)
    if len(meta.label.encode("utf-8")) > _LABEL_WORDS * 8:
        raise ValueError(f"transfer label {meta.label!r} is longer than {_LABEL_WORDS * 8} bytes")
    words[2:_HEAD_WORDS] = _pack_text(meta.label, _LABEL_WORDS)
    pos = _HEAD_WORDS
    for entry in meta.entries:
        needed = 1 if entry is None else 2 + len(entry.shape)
        if pos + needed > META_WORDS:
            raise ValueError(
                f"transfer {meta.label!r} has too many tensors or dimensions for one header "
                f"({len(meta.entries)} tensors; at most {META_WORDS - _HEAD_WORDS} header words)"
            )
        if entry is None:
            words[pos] = 0
        else:
            if entry.dtype not in DTYPE_NAMES:
                raise ValueError(f"dtype {entry.dtype!r} cannot be sent; supported: {', '.join(DTYPE_NAMES)}")
            words[pos] = DTYPE_NAMES.index(entry.dtype) + 1
            words[pos + 1] = len(entry.shape)
            words[pos + 2 : pos + needed] = entry.shape
        pos += needed
    return words


def encode_abort(text: str) -> np.ndarray:
    """The header words of an abort notice carrying ``text`` (truncated to fit)."""
    words = np.zeros(META_WORDS, dtype=np.int64)
    words[0] = _ABORT
    words[1:] = _pack_text(text, META_WORDS - 1)
    return words


def decode(words: np.ndarray) -> GroupMeta | AbortNotice:
    """Parse header words; raises ``ValueError`` for anything that is not a header."""
    if words.shape != (META_WORDS,) or words.dtype != np.int64:
        raise ValueError(f"a header is {META_WORDS} int64 words, got {words.dtype}{list(words.shape)}")
    if words[0] == _ABORT:
        return AbortNotice(_unpack_text(words[1:]))
    if words[0] != _MAGIC:
        raise ValueError(
            f"not a transfer header (first word {int(words[0]):#x}); the message order is broken"
        )
    count, label = int(words[1]), _unpack_text(words[2:_HEAD_WORDS])
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
    return GroupMeta(label, tuple(entries))
