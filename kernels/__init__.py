"""Compute graphs shared by the graph and pynative executors (installed as graph_exec.kernels).

Every kernel is a plain function of tensors made by a ``make_*`` factory over a user's cell.
The graph executor compiles it with ``mindspore.jit``, the pynative executor calls it eagerly,
so both run exactly the same code. Kernels know nothing about schedules or communication.
"""

from .autodiff import FLOAT_DTYPES, as_tuple, grads_of, is_float, value_and_grads
from .grad_buffers import BUFFER_PREFIX, GradBuffers, accumulate, make_buffer, make_zero_grads
from .preprocess import make_preprocess_backward, make_preprocess_forward
from .stage import BackwardLayout, make_last_stage_step, make_stage_backward, make_stage_forward

__all__ = [
    "BUFFER_PREFIX",
    "FLOAT_DTYPES",
    "BackwardLayout",
    "GradBuffers",
    "accumulate",
    "as_tuple",
    "grads_of",
    "is_float",
    "make_buffer",
    "make_last_stage_step",
    "make_preprocess_backward",
    "make_preprocess_forward",
    "make_stage_backward",
    "make_stage_forward",
    "make_zero_grads",
    "value_and_grads",
]
