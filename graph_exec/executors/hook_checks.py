"""The checks on what a hook's caller passes and on what a loss returns.

Kept apart from the executor so the messages (which name the value and what is allowed) live
in one place; every function here raises :class:`HookArgumentError` or :class:`HookTypeError`
and touches no executor state.
"""

from __future__ import annotations

from typing import Any

from mindspore import Tensor

from graph_exec.kernels import is_float

from .base import MaybeTensors
from .errors import HookArgumentError, HookTypeError
from .signature import TensorSpec
from .tape import A_TUPLE, NOT_A_TUPLE

#: What a per-token loss function must return.
TOKEN_LOSS_NEEDED = (
    "loss_reduction='token' needs the loss (loss_fn, or the last chunk without one) to return "
    "(sum_of_token_losses, token_count)"
)


#: What a per-micro-batch loss function must return.
SCALAR_LOSS_NEEDED = (
    "the loss must be a scalar tensor (a per-token loss returning (sum, count) needs loss_reduction='token')"
)


def check_scalar_loss(where: str, loss: Any) -> None:
    if not isinstance(loss, Tensor):
        raise HookArgumentError(f"last_stage_step({where}): {SCALAR_LOSS_NEEDED}, got {type(loss).__name__}")
    if tuple(loss.shape) != ():
        raise HookArgumentError(
            f"last_stage_step({where}): the loss must be a scalar, got shape {list(loss.shape)}"
        )


def check_loss(where: str, loss: Any, token_loss: bool) -> None:
    """A scalar loss, or with ``token_loss`` a (scalar sum, scalar count) pair."""
    if not token_loss:
        check_scalar_loss(where, loss)
        return
    if isinstance(loss, Tensor):
        raise HookArgumentError(f"last_stage_step({where}): {TOKEN_LOSS_NEEDED}, got one tensor")
    if not isinstance(loss, tuple | list) or len(loss) != 2 or not all(isinstance(t, Tensor) for t in loss):
        got = f"{len(loss)} values" if isinstance(loss, tuple | list) else type(loss).__name__
        raise HookArgumentError(f"last_stage_step({where}): {TOKEN_LOSS_NEEDED}, got {got}")
    for part, tensor in zip(("sum_of_token_losses", "token_count"), loss, strict=True):
        if tuple(tensor.shape) != ():
            raise HookArgumentError(
                f"last_stage_step({where}): {part} must be a scalar, got shape {list(tensor.shape)}"
            )


def check_loss_count(where: str, count: int, token_loss: bool) -> None:
    """A loss of ``count`` tensors (one, or a tuple of ``count``) is what ``token_loss`` asks."""
    if token_loss and count == 1:
        raise HookArgumentError(f"last_stage_step({where}): {TOKEN_LOSS_NEEDED}, got one tensor")
    if not token_loss and count != 1:
        raise HookArgumentError(f"last_stage_step({where}): {SCALAR_LOSS_NEEDED}, got a tuple")


def loss_kind_error(where: str, exc: ValueError) -> HookArgumentError | None:
    """The error to raise for the tape's refusal of a loss of the wrong kind (a tensor where a
    tuple was differentiated, or the reverse), or ``None`` for any other ``ValueError``."""
    if str(exc) == NOT_A_TUPLE:
        return HookArgumentError(f"last_stage_step({where}): {TOKEN_LOSS_NEEDED}, got one tensor")
    if str(exc) == A_TUPLE:
        return HookArgumentError(f"last_stage_step({where}): {SCALAR_LOSS_NEEDED}, got a tuple")
    return None


def check_cotangents(
    where: str, outputs: tuple[TensorSpec, ...], cotangents: MaybeTensors
) -> tuple[int, ...]:
    """Check ``cotangents`` against the output specs; return the positions that are present."""
    if len(cotangents) != len(outputs):
        raise HookArgumentError(
            f"{where}: expected {len(outputs)} cotangent(s), one per output, got {len(cotangents)}"
        )
    present = []
    for index, (cotangent, spec) in enumerate(zip(cotangents, outputs, strict=True)):
        if cotangent is None:
            continue
        if not isinstance(cotangent, Tensor):
            raise HookTypeError(
                f"{where}: cotangent {index} must be a Tensor or None, got {type(cotangent).__name__}"
            )
        got = TensorSpec.of(cotangent)
        if got != spec:
            raise HookArgumentError(f"{where}: cotangent {index} is {got}, but output {index} is {spec}")
        if not is_float(cotangent):
            raise HookArgumentError(
                f"{where}: output {index} is {spec} and cannot take a gradient; pass None"
            )
        present.append(index)
    return tuple(present)
