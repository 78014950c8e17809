"""The checksum of tied copies (:mod:`graph_exec.runtime.tied_check`): exact, order-free, in
float32 slots whose signed sum is zero iff the copies' bits are equal."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter

from graph_exec.errors import TiedCopiesDriftError
from graph_exec.msenv import prepare_mindspore
from graph_exec.runtime.tied_check import LIMB, TiedCopiesCheck

prepare_mindspore("CPU")
PAIR = ("embed.weight", "head.weight")


def _slots(first: np.ndarray, second: np.ndarray, dtype) -> np.ndarray:
    """The summed slots of a pair held on two ranks: each rank stamps its copy, then a sum."""
    total = np.zeros(2, np.float32)
    for name, values in zip(PAIR, (first, second), strict=True):
        param = Parameter(ms.Tensor(values).astype(dtype), name=name)
        check = TiedCopiesCheck([PAIR], {name: param})
        check.stamp()
        total = total + check.slots.asnumpy()
    return total


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16])
def test_equal_copies_sum_to_zero_and_any_changed_bit_or_swapped_row_does_not(dtype) -> None:
    values = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    assert np.array_equal(_slots(values, values, dtype), [0.0, 0.0])
    decayed = values * np.float32(0.999)  # what a weight decay on one copy only does
    assert np.any(_slots(values, decayed, dtype) != 0)
    assert np.any(_slots(values, values * 2, dtype) != 0)  # only the exponent bits differ
    swapped = values[[1, 0, 2, 3, 4, 5]]  # the same row sums, in another order
    weighted = _slots(values, swapped, dtype)
    assert weighted[0] == 0 and weighted[1] != 0


def test_checksums_are_exact_float32_integers_below_the_limb() -> None:
    param = Parameter(ms.Tensor(np.full((3, 4), 1e30, np.float32)), name=PAIR[0])
    check = TiedCopiesCheck([PAIR], {PAIR[0]: param})
    check.stamp()
    slots = check.slots.asnumpy()
    assert np.all((slots >= 0) & (slots < LIMB)) and np.array_equal(slots, np.round(slots))


def test_a_pair_whose_slots_do_not_cancel_is_named() -> None:
    param = Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name=PAIR[0])
    check = TiedCopiesCheck([PAIR], {PAIR[0]: param})
    check.stamp()  # the other copy's negative checksum never came
    with pytest.raises(TiedCopiesDriftError, match=r"'embed.weight' and 'head.weight' no longer hold"):
        check.verify()
