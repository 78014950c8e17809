"""Data frames: tensor placement, the in-band prefix, and the layout cache's identity rules."""

import numpy as np
import pytest

from graph_exec.transport.frames import (
    ALIGNMENT,
    DATA,
    PREFIX_BYTES,
    PREFIX_WORDS,
    layout_of,
    read_prefix,
    write_prefix,
)
from graph_exec.transport.meta import CONTROL_BYTES, TensorMeta, pack_label


def test_tensors_sit_aligned_after_the_prefix_and_none_takes_no_bytes():
    entries = (TensorMeta("float32", (3, 5)), None, TensorMeta("int8", (7,)), TensorMeta("float64", ()))
    layout = layout_of(entries)
    starts = [slot[0] for slot in layout.slots if slot is not None]
    assert layout.slots[1] is None
    assert starts == [PREFIX_BYTES, PREFIX_BYTES + 64, PREFIX_BYTES + 128]
    assert all(start % ALIGNMENT == 0 for start in starts)
    assert layout.nbytes == PREFIX_BYTES + 128 + 8  # no padding after the last tensor


def test_views_share_the_frame_and_keep_dtypes_and_shapes():
    entries = (TensorMeta("float32", (2, 3)), None, TensorMeta("bfloat16", (4,)), TensorMeta("bool", (0, 2)))
    layout = layout_of(entries)
    frame = np.zeros(layout.nbytes, np.uint8)
    a, none, b, empty = layout.views(frame)
    assert none is None and a.shape == (2, 3) and a.dtype == np.float32
    assert b.dtype == np.uint16 and b.shape == (4,)  # bfloat16 bits travel as uint16
    assert empty.shape == (0, 2)
    a[...] = np.arange(6).reshape(2, 3)
    b[...] = 0x3FC0
    again = layout.views(frame)
    assert np.array_equal(again[0], np.arange(6).reshape(2, 3)) and np.all(again[2] == 0x3FC0)
    assert np.shares_memory(a, frame) and np.shares_memory(b, frame)


def test_layouts_are_shared_per_entries_and_differ_with_shape_or_dtype():
    one = (TensorMeta("float32", (4, 8)),)
    assert layout_of(one) is layout_of((TensorMeta("float32", (4, 8)),))
    other_shape = layout_of((TensorMeta("float32", (8, 4)),))
    other_dtype = layout_of((TensorMeta("int32", (4, 8)),))
    assert other_shape.nbytes == layout_of(one).nbytes  # same size: only the digest tells them apart
    assert len({layout_of(one).digest, other_shape.digest, other_dtype.digest}) == 3


def test_prefix_round_trip_names_label_sequence_size_and_layout():
    layout = layout_of((TensorMeta("float16", (10,)),))
    frame = np.zeros(max(layout.nbytes, CONTROL_BYTES), np.uint8)
    write_prefix(
        frame[:PREFIX_BYTES].view(np.int64), layout, pack_label("Bsend3.12").tolist(), epoch=2, seq=77
    )
    prefix = read_prefix(frame)
    assert (prefix.kind, prefix.epoch, prefix.seq) == (DATA, 2, 77)
    assert (prefix.nbytes, prefix.digest, prefix.label) == (layout.nbytes, layout.digest, "Bsend3.12")
    assert PREFIX_WORDS * 8 == PREFIX_BYTES == 64


def test_a_layout_a_header_cannot_describe_is_refused_before_sending():
    with pytest.raises(ValueError, match="cannot be sent"):
        layout_of((TensorMeta("complex64", (2,)),))
    with pytest.raises(ValueError, match="too many tensors"):
        layout_of(tuple(TensorMeta("float32", (1, 2, 3, 4, 5, 6)) for _ in range(20)))
