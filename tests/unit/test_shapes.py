"""Shape buckets and the bounded kernel cache, without MindSpore: what is padded, the masks, every
refusal, and the least-recently-used order of the cache."""

from __future__ import annotations

import numpy as np
import pytest

from graph_exec.executors.errors import ExecutorConfigError
from graph_exec.executors.kernel_cache import KernelCache
from graph_exec.runtime.shapes import check_shapes


def test_static_is_nothing_and_buckets_are_sorted_by_dim() -> None:
    assert check_shapes("static", None, 0) is None
    assert check_shapes("dynamic", None, 0) is None
    buckets = check_shapes("buckets", {2: [4, 8], 1: (16, 32)}, -1)
    assert buckets.buckets == ((1, (16, 32)), (2, (4, 8)))
    assert buckets.pad_value == -1


def test_inputs_and_labels_are_padded_to_the_next_bucket_with_one_mask_per_dim() -> None:
    buckets = check_shapes("buckets", {1: (4, 8, 16)}, 7)
    ids = np.arange(10, dtype=np.int32).reshape(2, 5)
    labels = ids + 100
    (padded,), (padded_labels, mask) = buckets.pad((ids,), labels)
    assert padded.shape == (2, 8) and padded.dtype == np.int32
    np.testing.assert_array_equal(padded[:, :5], ids)
    assert (padded[:, 5:] == 7).all()
    np.testing.assert_array_equal(padded_labels[:, :5], labels)
    assert mask.dtype == np.float32 and mask.shape == (2, 8)
    np.testing.assert_array_equal(mask, np.array([[1, 1, 1, 1, 1, 0, 0, 0]] * 2, np.float32))


def test_a_length_on_a_bucket_is_not_copied_and_lower_rank_tensors_are_left_alone() -> None:
    buckets = check_shapes("buckets", {1: (4, 8)}, 0)
    ids = np.zeros((3, 8), np.int32)
    classes = np.zeros((3,), np.int32)  # a label without the padded dim: not padded
    (same,), (label, mask) = buckets.pad((ids,), (classes,))
    assert same is ids and label is classes and mask.all()


def test_a_user_mask_among_the_labels_is_padded_with_zeros_when_the_pad_value_is_zero() -> None:
    buckets = check_shapes("buckets", {1: (8,)}, 0)
    ids, labels, own = np.ones((2, 3), np.int32), np.ones((2, 3), np.int32), np.ones((2, 3), np.float32)
    _, (_, own_padded, mask) = buckets.pad((ids,), (labels, own))
    np.testing.assert_array_equal(own_padded, mask)


def test_two_dims_give_two_masks_in_dim_order() -> None:
    buckets = check_shapes("buckets", {3: (4,), 2: (2, 6)}, 0)
    images = np.ones((1, 3, 5, 3), np.float32)
    (padded,), masks = buckets.pad((images,), None)
    assert padded.shape == (1, 3, 6, 4)
    assert [m.shape for m in masks] == [(1, 6), (1, 4)]
    assert masks[0].sum() == 5 and masks[1].sum() == 3


@pytest.mark.parametrize(
    ("shapes", "buckets", "pad", "error", "words"),
    [
        (
            "bucket",
            {1: (4,)},
            0,
            ValueError,
            "shapes must be one of 'static', 'buckets', 'dynamic', got 'bucket'",
        ),
        ("dynamic", {1: (4,)}, 0, ValueError, "needs shapes='buckets' (shapes is 'dynamic'"),
        ("static", {1: (4,)}, 0, ValueError, "needs shapes='buckets'"),
        ("buckets", None, 0, ValueError, "needs shape_buckets, a non-empty dict"),
        ("buckets", {}, 0, ValueError, "needs shape_buckets, a non-empty dict"),
        ("buckets", {0: (4,)}, 0, ValueError, "dim 0 is the batch"),
        ("buckets", {-1: (4,)}, 0, ValueError, "dim must be an int >= 1"),
        ("buckets", {1.0: (4,)}, 0, ValueError, "dim must be an int >= 1"),
        ("buckets", {1: ()}, 0, ValueError, "shape_buckets[1] must be a non-empty tuple of positive ints"),
        ("buckets", {1: (0, 4)}, 0, ValueError, "positive ints"),
        ("buckets", {1: 64}, 0, ValueError, "positive ints, got 64"),
        (
            "buckets",
            {1: (64, 32, 128)},
            0,
            ValueError,
            "strictly increasing, got (64, 32, 128); write (32, 64, 128)",
        ),
        ("buckets", {1: (32, 32)}, 0, ValueError, "strictly increasing"),
        ("buckets", {1: (32,)}, "0", ValueError, "shape_pad_value must be an int or a float, got '0'"),
        ("buckets", {1: (32,)}, True, ValueError, "shape_pad_value must be an int or a float"),
    ],
)
def test_bad_settings_are_refused_naming_the_value_and_what_is_allowed(
    shapes, buckets, pad, error, words
) -> None:
    with pytest.raises(error) as info:
        check_shapes(shapes, buckets, pad)
    assert words in str(info.value)


def test_a_length_above_the_largest_bucket_and_disagreeing_lengths_are_refused() -> None:
    buckets = check_shapes("buckets", {1: (4, 8)}, 0)
    with pytest.raises(ValueError, match=r"input 0 has length 9 on dim 1, above the largest shape bucket 8"):
        buckets.pad((np.zeros((2, 9), np.int32),), None)
    with pytest.raises(ValueError, match=r"label 0 has length 5 on dim 1 but input 0 has 4"):
        buckets.pad((np.zeros((2, 4), np.int32),), np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match=r"no input or label has 2 or more dims"):
        buckets.pad((np.zeros((2,), np.int32),), None)


def test_the_kernel_cache_evicts_the_least_recently_used_and_counts_it() -> None:
    cache = KernelCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent: "b" goes first
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache["c"] == 3
    assert len(cache) == 2 and cache.evictions == 1
    cache.clear()
    assert len(cache) == 0 and cache.evictions == 1  # a clear is not an eviction


def test_the_kernel_cache_counts_the_bytes_its_entries_say_they_hold() -> None:
    """An entry with tensors of its own (the split backward's probes and stores) says its
    ``nbytes``; the bytes go with the entry when it is evicted."""

    class Holding:
        def __init__(self, nbytes: int) -> None:
            self.nbytes = nbytes

    cache = KernelCache(2)
    cache.put("plain", lambda: None)
    cache.put("a", Holding(100))
    assert cache.nbytes() == 100
    cache.put("b", Holding(40))  # evicts "plain"
    assert cache.nbytes() == 140
    cache.put("c", Holding(1))  # evicts "a" and its 100 bytes
    assert cache.nbytes() == 41 and cache.evictions == 2


@pytest.mark.parametrize("size", [0, -1, 2.0, True, None])
def test_the_kernel_cache_size_must_be_a_positive_int(size) -> None:
    with pytest.raises(ExecutorConfigError, match=f"kernel_cache_size must be a positive int, got {size!r}"):
        KernelCache(size)
