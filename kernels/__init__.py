"""Compute graphs shared by the graph and pynative executors (installed as graph_exec.kernels).

Every kernel is a plain function of tensors made by a ``make_*`` factory over a user's cell.
The graph executor compiles it with ``mindspore.jit``, the pynative executor calls it eagerly,
so both run exactly the same code. Kernels know nothing about schedules or communication.
"""

from .autodiff import FLOAT_DTYPES, as_tuple, is_float
from .grad_buffers import BUFFER_PREFIX, GradBuffers, make_accumulate, make_buffer, make_zero_grads
from .grad_ops import (
    HOST_DTYPES,
    LOW_PRECISION,
    HostGradients,
    accumulator_dtype,
    make_add_back,
    make_multiply_grads,
    make_norm_part,
    make_set_aside,
    make_unscale_and_check,
)
from .preprocess import make_preprocess_forward
from .stage import make_stage_forward, make_stage_loss

__all__ = [
    "BUFFER_PREFIX",
    "FLOAT_DTYPES",
    "HOST_DTYPES",
    "LOW_PRECISION",
    "GradBuffers",
    "HostGradients",
    "accumulator_dtype",
    "as_tuple",
    "is_float",
    "make_accumulate",
    "make_add_back",
    "make_buffer",
    "make_multiply_grads",
    "make_norm_part",
    "make_preprocess_forward",
    "make_set_aside",
    "make_stage_forward",
    "make_stage_loss",
    "make_unscale_and_check",
    "make_zero_grads",
]
