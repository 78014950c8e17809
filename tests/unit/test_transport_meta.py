"""Transfer headers: round trips, None entries kept in place, abort notices, clear limits."""

import numpy as np
import pytest

from graph_exec.transport.meta import (
    META_WORDS,
    AbortNotice,
    GroupMeta,
    TensorMeta,
    decode,
    encode_abort,
    encode_group,
)


def test_group_round_trip_keeps_positions_dtypes_and_shapes():
    meta = GroupMeta(
        "GRADrecv+bwd12",
        (TensorMeta("float32", (4, 8, 16)), None, TensorMeta("int32", (4,)), TensorMeta("bfloat16", ())),
    )
    words = encode_group(meta)
    assert words.shape == (META_WORDS,) and words.dtype == np.int64
    assert decode(words) == meta


def test_empty_group_and_zero_sized_tensor():
    assert decode(encode_group(GroupMeta("OUTsend3", ()))) == GroupMeta("OUTsend3", ())
    meta = GroupMeta("Fsend0.0", (TensorMeta("float32", (0, 3)),))
    assert decode(encode_group(meta)).entries[0].numel == 0


def test_abort_notice_round_trip_and_truncation():
    assert decode(encode_abort("rank 1: step F1.3 raised ValueError")) == AbortNotice(
        "rank 1: step F1.3 raised ValueError"
    )
    long = decode(encode_abort("x" * 5000))
    assert isinstance(long, AbortNotice) and len(long.text) == (META_WORDS - 1) * 8


def test_garbage_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="message order is broken"):
        decode(np.arange(META_WORDS, dtype=np.int64))
    with pytest.raises(ValueError, match="int64 words"):
        decode(np.zeros(3, np.int64))


def test_limits_name_the_problem():
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_group(GroupMeta("x", (TensorMeta("complex64", (2,)),)))
    with pytest.raises(ValueError, match="longer than 32 bytes"):
        encode_group(GroupMeta("L" * 40, ()))
    with pytest.raises(ValueError, match="too many tensors"):
        encode_group(GroupMeta("x", tuple(TensorMeta("float32", (1, 2, 3, 4, 5, 6)) for _ in range(20))))
