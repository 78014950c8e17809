"""Control messages: headers round trip with epoch and sequence number, None entries keep their
place, abort notices and hellos, clear limits."""

import numpy as np
import pytest

from graph_exec.transport.meta import (
    ABORT,
    CONTROL_BYTES,
    HEADER,
    META_WORDS,
    AbortNotice,
    GroupMeta,
    Header,
    Hello,
    TensorMeta,
    decode,
    encode_abort,
    encode_header,
    encode_hello,
    first_word,
    split_first_word,
)


def test_header_round_trip_keeps_positions_dtypes_shapes_epoch_and_seq():
    meta = GroupMeta(
        "GRADrecv+bwd12",
        (TensorMeta("float32", (4, 8, 16)), None, TensorMeta("int32", (4,)), TensorMeta("bfloat16", ())),
    )
    words = encode_header(meta, epoch=3, seq=41)
    assert words.shape == (META_WORDS,) and words.dtype == np.int64 and words.nbytes == CONTROL_BYTES
    assert decode(words) == Header(3, 41, meta)


def test_empty_group_and_zero_sized_tensor():
    assert decode(encode_header(GroupMeta("OUTsend3", ()), 0, 0)).meta == GroupMeta("OUTsend3", ())
    meta = GroupMeta("Fsend0.0", (TensorMeta("float32", (0, 3)),))
    assert decode(encode_header(meta, 0, 0)).meta.entries[0].numel == 0


def test_first_word_carries_kind_and_epoch():
    assert split_first_word(first_word(HEADER, 7)) == (HEADER, 7)
    assert split_first_word(encode_abort("x", 2)[0]) == (ABORT, 2)
    with pytest.raises(ValueError, match="epoch"):
        first_word(HEADER, 1 << 32)


def test_abort_notice_and_hello_round_trip():
    assert decode(encode_abort("rank 1: step F1.3 raised ValueError", 5)) == AbortNotice(
        5, "rank 1: step F1.3 raised ValueError"
    )
    long = decode(encode_abort("x" * 5000, 0))
    assert isinstance(long, AbortNotice) and len(long.text) == (META_WORDS - 1) * 8
    assert decode(encode_hello(9)) == Hello(9)


def test_garbage_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="message order is broken"):
        decode(np.arange(META_WORDS, dtype=np.int64))
    with pytest.raises(ValueError, match="int64 words"):
        decode(np.zeros(3, np.int64))


def test_limits_name_the_problem():
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_header(GroupMeta("x", (TensorMeta("complex64", (2,)),)), 0, 0)
    with pytest.raises(ValueError, match="longer than 32 bytes"):
        encode_header(GroupMeta("L" * 40, ()), 0, 0)
    with pytest.raises(ValueError, match="too many tensors"):
        encode_header(
            GroupMeta("x", tuple(TensorMeta("float32", (1, 2, 3, 4, 5, 6)) for _ in range(20))), 0, 0
        )
