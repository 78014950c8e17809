"""What a forward leaves for its backward, and how an abandoned one is consumed.

Shared by the stage and the preprocess hooks: both keep a :class:`KeptForward` per forward,
hand its tensors back to the tape at backward, and on an aborted step consume every recorded
one with zero upstream gradients (:func:`release`), so none stays in MindSpore's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mindspore import ops

from .base import MaybeTensors, Tensors
from .signature import TensorSpec
from .split_backward import SplitTape
from .tape import Tape, free_tapes


@dataclass(frozen=True)
class KeptForward:
    """What a forward leaves for its backward.

    ``args``: the kernel's positional tensors (the backward hands these very objects to the
    tape, which finds its recorded forward by them); ``outputs``: the output specs the
    cotangents are checked against; ``tape``: ``None`` when nothing is differentiated;
    ``recorded``: whether the forward ran under the tape (``False``: recompute at backward);
    ``grad_inputs``: positions of the inputs whose gradient the backward returns;
    ``split``: the probed tape of a forward recorded for the split backward (its linear layers'
    weight gradients left to ``W``), with ``saved`` the inputs those layers saved.
    """

    args: Tensors
    outputs: tuple[TensorSpec, ...]
    tape: Tape | None
    recorded: bool
    grad_inputs: tuple[int, ...] = ()
    split: SplitTape | None = None
    saved: Tensors = ()


def upstream_grads(outputs: tuple[TensorSpec, ...], cotangents: MaybeTensors) -> tuple[Any, ...]:
    """The upstream gradient of a tuple-output kernel: the cotangents, zeros where missing."""
    return tuple(
        ops.zeros(spec.shape, spec.dtype) if cotangent is None else cotangent
        for cotangent, spec in zip(cotangents, outputs, strict=True)
    )


def release(kept: KeptForward) -> bool:
    """Consume a recorded forward without using its gradients; on failure free every tape of
    the process instead and return ``False``."""
    saved_sens = kept.split.saved_sens if kept.split is not None else ()
    try:
        kept.tape.backward(
            kept.args, (*upstream_grads(kept.outputs, (None,) * len(kept.outputs)), *saved_sens)
        )
    except Exception:  # the step is being aborted already: never mask its error
        free_tapes()
        return False
    return True
