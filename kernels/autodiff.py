"""One differentiation wrapper shared by every backward kernel.

``mindspore.value_and_grad`` changes the shape of its result with its arguments (a bare tensor
for one input position, no weight part without weights, an error with neither). Kernels know
at build time which inputs and which parameters they differentiate, so this module resolves
those cases once, in Python, and hands back a function with one fixed result shape that works
both eagerly and inside ``mindspore.jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
from mindspore import ParameterTuple, Tensor
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


def value_and_grads(
    objective: Callable[..., Any],
    grad_inputs: tuple[int, ...],
    weights: ParameterTuple,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, tuple, tuple]]:
    """``f(*args, **kwargs) -> (value, input_grads, weight_grads)`` for what was asked.

    ``input_grads`` follows ``grad_inputs`` and ``weight_grads`` follows ``weights``; either is
    empty when nothing was asked; keyword arguments are passed through undifferentiated. With ``has_aux`` the objective returns ``(scalar, aux)`` and
    only the scalar is differentiated. At least one of the two must be non-empty.
    """
    if not grad_inputs and not len(weights):
        raise ValueError("nothing to differentiate: no input positions and no weights")
    position = None if not grad_inputs else grad_inputs[0] if len(grad_inputs) == 1 else grad_inputs
    grad_fn = ms.value_and_grad(
        objective, grad_position=position, weights=weights if len(weights) else None, has_aux=has_aux
    )
    num_inputs = len(grad_inputs)
    num_weights = len(weights)

    def run(*args: Any, **kwargs: Any) -> tuple[Any, tuple, tuple]:
        value, grads = grad_fn(*args, **kwargs)
        if num_inputs and num_weights:
            return value, as_tuple(grads[0]), grads[1]
        if num_inputs:
            return value, as_tuple(grads), ()
        return value, (), grads

    return run


def grads_of(
    objective: Callable[..., Any],
    grad_inputs: tuple[int, ...],
    weights: ParameterTuple,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, tuple, tuple]]:
    """``f(*args, **kwargs) -> (aux, input_grads, weight_grads)``: :func:`value_and_grads`
    without the objective's value, which every kernel drops.

    ``aux`` is the objective's second output with ``has_aux`` (the objective returns
    ``(scalar, aux)``), else ``None``. Inside ``mindspore.jit`` a dropped value makes MindSpore
    2.10 log "Some side effect nodes were eliminated by mistake" on every compile (measured:
    gone with ``mindspore.grad``, same gradients); not asking for it avoids that.
    """
    if not grad_inputs and not len(weights):
        raise ValueError("nothing to differentiate: no input positions and no weights")
    position = None if not grad_inputs else grad_inputs[0] if len(grad_inputs) == 1 else grad_inputs
    grad_fn = ms.grad(
        objective, grad_position=position, weights=weights if len(weights) else None, has_aux=has_aux
    )
    num_inputs = len(grad_inputs)
    num_weights = len(weights)

    def run(*args: Any, **kwargs: Any) -> tuple[Any, tuple, tuple]:
        aux = None
        grads = grad_fn(*args, **kwargs)
        if has_aux:
            grads, aux = grads[0], grads[1][0]
        if num_inputs and num_weights:
            return aux, as_tuple(grads[0]), grads[1]
        if num_inputs:
            return aux, as_tuple(grads), ()
        return aux, (), grads

    return run
