"""Small facts about tensors that every kernel and both executors share.

Kernels never differentiate themselves: the executors run them under MindSpore's autograd
tape. What they share is which tensors can carry a gradient, and how a cell's output is turned
into the one shape (a tuple) the executors and the tape's upstream gradient rely on.
"""

from __future__ import annotations

from typing import Any

from mindspore import Tensor
from mindspore import dtype as mstype

#: Dtypes that carry gradients; every other input (token ids, masks) is passed through.
FLOAT_DTYPES = frozenset({mstype.float16, mstype.bfloat16, mstype.float32, mstype.float64})


def is_float(tensor: Tensor) -> bool:
    """Whether ``tensor`` can have a gradient (integer and bool tensors cannot)."""
    return tensor.dtype in FLOAT_DTYPES


def as_tuple(value: Any) -> tuple:
    """A cell's output as a tuple: a single tensor becomes a 1-tuple (graph-safe)."""
    if isinstance(value, tuple):
        return value
    return (value,)
