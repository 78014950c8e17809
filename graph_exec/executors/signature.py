"""Hashable descriptions of hook arguments: what decides whether a kernel can be reused.

A compiled graph is specialised to the shapes and dtypes of its tensor arguments, to which
outputs carry a cotangent, and to the values of non-tensor keyword arguments. Two calls with
equal signatures run the same graph; any difference means another graph (another compile in
graph mode). The executors build their cache keys from these pieces only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor

from .errors import HookTypeError


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: Any

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tuple(int(d) for d in tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


def shape_free(key: Any) -> Any:
    """``key`` with the sizes of every :class:`TensorSpec` in it dropped (rank and dtype kept):
    the cache key of a kernel compiled for dynamic shapes, which serves every size."""
    if isinstance(key, TensorSpec):
        return TensorSpec((-1,) * len(key.shape), key.dtype)
    if isinstance(key, tuple):
        return tuple(shape_free(part) for part in key)
    return key


def tensor_specs(tensors: Sequence[Any], what: str) -> tuple[TensorSpec, ...]:
    """Specs of ``tensors``; ``what`` names the argument in the error for a non-tensor."""
    specs = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise HookTypeError(f"{what}[{index}] must be a mindspore Tensor, got {type(tensor).__name__}")
        specs.append(TensorSpec.of(tensor))
    return tuple(specs)


def split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Keyword arguments split into tensors (graph inputs) and constants (baked into a graph)."""
    tensors = {name: value for name, value in kwargs.items() if isinstance(value, Tensor)}
    constants = {name: value for name, value in kwargs.items() if not isinstance(value, Tensor)}
    return tensors, constants


def kwargs_key(tensors: Mapping[str, Tensor], constants: Mapping[str, Any]) -> tuple:
    """Key part for keyword arguments: tensor specs by name, constants by type and value.

    The type is part of the key because ``1 == 1.0 == True`` would otherwise share a graph
    built for a different constant.
    """
    parts: list[tuple] = [(name, TensorSpec.of(value)) for name, value in sorted(tensors.items())]
    for name, value in sorted(constants.items()):
        try:
            hash(value)
        except TypeError:
            raise HookTypeError(
                f"keyword argument {name!r} must be a Tensor or a hashable constant, got {type(value).__name__}"
            ) from None
        parts.append((name, type(value).__qualname__, value))
    return tuple(parts)
