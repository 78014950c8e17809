"""Read the chosen tensors of a MindSpore ``.ckpt`` file, and nothing else, into memory.

``mindspore.load_checkpoint(path, choice_func=...)`` reads the whole file and parses all of it
(``f.read()`` then ``Checkpoint.ParseFromString``; MindSpore 2.10 ``_parse_ckpt_proto``) before
``choice_func`` skips a name: a rank that resumes on another plan grew by 1.6-4.3 × its share
while loading (the bytes of every file it opens, the parsed message, then the tensors; measured,
docs/restarts.md), against 1.02-1.08 × with this reader. The file is a protobuf ``Checkpoint`` of repeated ``Value {tag, tensor}`` records, each
a length-prefixed field, so this module walks the records' headers and their ``tag`` and seeks
past every record it does not want: a rank's memory while loading is its own tensors plus one
record being converted. A large tensor saved in slices (consecutive records of one tag) is
joined. Map parameters (MindSpore's ``MapParameter``) are not read: no graph_exec rank owns one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

#: The only top-level field of ``Checkpoint``: ``repeated Value value = 1`` (length-delimited).
_VALUE_KEY = (1 << 3) | 2
#: ``Value.tag`` (``string tag = 1``), written first in each record.
_TAG_KEY = (1 << 3) | 2
#: MindSpore's optional trailer: ``b"crc_num"`` and 10 bytes of checksum.
_CRC_TRAILER = 17


class _Counted:
    """A file read through this object counts the bytes it reads (what the rank brings in)."""

    def __init__(self, source: BinaryIO) -> None:
        self.source, self.bytes = source, 0

    def read(self, size: int) -> bytes:
        data = self.source.read(size)
        self.bytes += len(data)
        return data

    def seek(self, offset: int) -> None:
        self.source.seek(offset)

    def tell(self) -> int:
        return self.source.tell()


def _varint(source: _Counted) -> int | None:
    """A protobuf base-128 varint read from ``source``; ``None`` at the end of the file."""
    value, shift = 0, 0
    while True:
        byte = source.read(1)
        if not byte:
            if shift:
                raise ValueError("the file ends inside a record header (truncated?)")
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7


def _records(source: _Counted, end: int) -> Iterator[tuple[str, int, int]]:
    """``(tag, offset, length)`` of each ``Value`` record, reading only its header and name."""
    while source.tell() < end:
        key = _varint(source)
        if key is None:
            return
        length = _varint(source)
        start = source.tell()
        if key != _VALUE_KEY or length is None or _varint(source) != _TAG_KEY:
            raise ValueError(f"no checkpoint record at byte {start}: not a MindSpore .ckpt file, or damaged")
        size = _varint(source)
        if size is None:
            raise ValueError(f"the checkpoint record at byte {start} is cut short (truncated?)")
        yield source.read(size).decode(), start, length
        source.seek(start + length)


def read(path: str, names: set[str]) -> tuple[dict[str, Any], int]:
    """The tensors ``names`` of the ``.ckpt`` file at ``path`` (those it holds), and the number
    of bytes read from the file: their records, and the header and name of every record. Each
    tensor is made as soon as its last record is read, so at most one tensor's records are held
    besides the tensors made."""
    import os

    from mindspore.train.checkpoint_pb2 import Checkpoint

    end = os.path.getsize(path)
    found: dict[str, Any] = {}
    with open(path, "rb") as raw:
        source = _Counted(raw)
        if end >= _CRC_TRAILER:
            source.seek(end - _CRC_TRAILER)
            if source.read(7) == b"crc_num":
                end -= _CRC_TRAILER
            source.seek(0)
        pending: tuple[str, list[Any]] | None = None
        for tag, start, length in _records(source, end):
            if pending is not None and pending[0] != tag:
                _finish(found, *pending)
                pending = None
            if tag not in names:
                continue
            source.seek(start)  # _records seeks past the record when it goes on
            record = Checkpoint.Value()
            record.ParseFromString(source.read(length))
            if not record.HasField("tensor"):
                raise ValueError(f"{tag!r} in {path} is not a dense tensor (a map parameter?)")
            pending = pending or (tag, [])
            pending[1].append(record.tensor)
        if pending is not None:
            _finish(found, *pending)
    return found, source.bytes


def _finish(found: dict[str, Any], tag: str, parts: list[Any]) -> None:
    """Make ``tag``'s tensor from its records (slices of one tensor are consecutive)."""
    from mindspore import Parameter
    from mindspore._c_expression import TensorPy
    from mindspore.train.serialization import tensor_to_ms_type

    content = parts[0].tensor_content if len(parts) == 1 else b"".join(p.tensor_content for p in parts)
    dims = () if list(parts[0].dims) == [0] else tuple(parts[0].dims)
    value = TensorPy.convert_bytes_to_tensor(content, dims, tensor_to_ms_type[parts[0].tensor_type])
    found[tag] = Parameter(value, name=tag)
