"""The kernel of the replicated preprocess block (an embedding, a frozen vision tower).

In MPipe Transpose a rank runs the preprocess forward for micro-batches it owns, ships the
result away and only later receives that result's gradient. The executors therefore run this
one kernel in two ways: plainly (the forward keeps nothing), or under the autograd tape
immediately followed by its gradient (the backward is a recompute, as no forward was kept).

The preprocess is called as ``cell(*inputs, **kwargs)``. The kernel takes every tensor as a
positional argument (the inputs, then the tensor keyword arguments in the order of
``tensor_names``): a tape differentiates positional arguments, and a compiled graph is then
independent of keyword handling. Every other keyword value is a constant fixed when the kernel
is made (it becomes part of the compiled graph, and of the executor's signature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mindspore import Tensor, nn

from .autodiff import as_tuple


def make_preprocess_forward(
    cell: nn.Cell, num_inputs: int, tensor_names: Sequence[str], constants: Mapping[str, Any]
) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs, *tensor_kwargs) -> outputs`` (always a tuple)."""
    names = tuple(tensor_names)
    constants = dict(constants)

    def preprocess_forward(*args: Tensor) -> tuple[Tensor, ...]:
        kwargs = {name: args[num_inputs + k] for k, name in enumerate(names)}
        return as_tuple(cell(*args[:num_inputs], **kwargs, **constants))

    return preprocess_forward
