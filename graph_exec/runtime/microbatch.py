"""Splitting a global batch into micro-batches, checked before any rank communicates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MicroBatches:
    """One step's data, cut along dim 0: per micro-batch its inputs, keyword inputs, labels."""

    inputs: tuple[tuple[Any, ...], ...]
    kwargs: tuple[dict[str, Any], ...]
    labels: tuple[tuple[Any, ...], ...] | None

    def __len__(self) -> int:
        return len(self.inputs)


def _is_tensor(value: Any) -> bool:
    from mindspore import Tensor

    return isinstance(value, Tensor)


def _as_tensor(name: str, value: Any) -> Any:
    """``value`` as a ``mindspore.Tensor``: numpy arrays are converted (copied, same dtype)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        from mindspore import Tensor

        return Tensor(np.ascontiguousarray(value))
    if not _is_tensor(value):
        raise TypeError(f"{name} must be a mindspore.Tensor or a numpy.ndarray, got {type(value).__name__}")
    return value


def _batch_size(name: str, value: Any) -> int:
    if value.ndim == 0:
        raise ValueError(f"{name} is a 0-d tensor; inputs are split into micro-batches along dim 0")
    return int(value.shape[0])


def _chunks(value: Any, micro: int) -> tuple[Any, ...]:
    size = value.shape[0] // micro
    return tuple(value[i * size : (i + 1) * size] for i in range(micro))


def split_batch(
    inputs: Sequence[Any], kwargs: Mapping[str, Any], labels: Any, micro_batch_num: int
) -> MicroBatches:
    """Cut every input, keyword input and label tensor into ``micro_batch_num`` equal parts.

    All of them must share the batch size on dim 0, at least the number of micro-batches (a
    smaller batch is its own error: an empty micro-batch is not a rounding problem) and
    divisible by it; the error names the tensor, its size and the number. numpy arrays are
    accepted and converted to ``mindspore.Tensor`` (same dtype) first.
    """
    if not inputs:
        raise ValueError("run() needs at least one input tensor (the global batch)")
    inputs = [_as_tensor(f"input {i}", t) for i, t in enumerate(inputs)]
    kwargs = {k: _as_tensor(f"keyword input {k!r}", t) for k, t in kwargs.items()}
    if labels is not None:
        if isinstance(labels, tuple | list):
            labels = tuple(_as_tensor(f"label {i}", t) for i, t in enumerate(labels))
        else:
            labels = _as_tensor("label 0", labels)
    named = [(f"input {i}", t) for i, t in enumerate(inputs)] + [
        (f"keyword input {k!r}", t) for k, t in kwargs.items()
    ]
    label_list = () if labels is None else (labels if isinstance(labels, tuple | list) else (labels,))
    named += [(f"label {i}", t) for i, t in enumerate(label_list)]
    sizes = {name: _batch_size(name, t) for name, t in named}
    first_name, batch = next(iter(sizes.items()))
    for name, size in sizes.items():
        if size != batch:
            raise ValueError(
                f"{name} has batch size {size} but {first_name} has {batch}: all must match on dim 0"
            )
    if batch < micro_batch_num:
        raise ValueError(
            f"batch size {batch} (dim 0 of {first_name}) is smaller than micro_batch_num={micro_batch_num}: "
            f"every micro-batch needs at least one row; pass at least {micro_batch_num} rows "
            f"(a multiple of {micro_batch_num}) or fewer micro-batches"
        )
    if batch % micro_batch_num:
        raise ValueError(
            f"batch size {batch} (dim 0 of {first_name}) is not divisible by micro_batch_num={micro_batch_num}; "
            f"use a batch size that is a multiple of {micro_batch_num}"
        )
    cut_inputs = list(zip(*(_chunks(t, micro_batch_num) for t in inputs), strict=True))
    cut_kwargs = [dict.fromkeys(kwargs) for _ in range(micro_batch_num)]
    for key, value in kwargs.items():
        for m, piece in enumerate(_chunks(value, micro_batch_num)):
            cut_kwargs[m][key] = piece
    cut_labels = (
        None
        if labels is None
        else tuple(zip(*(_chunks(t, micro_batch_num) for t in label_list), strict=True))
    )
    return MicroBatches(tuple(cut_inputs), tuple(cut_kwargs), cut_labels)


def permuted(batch: MicroBatches, order: Sequence[int]) -> MicroBatches:
    """``batch`` with user micro-batch ``order[m]`` as micro-batch ``m`` (the tower placement's
    decision, :mod:`graph_exec.schedule.placement`); the tensors are not copied."""
    if list(order) == list(range(len(batch))):
        return batch
    labels = None if batch.labels is None else tuple(batch.labels[u] for u in order)
    return MicroBatches(tuple(batch.inputs[u] for u in order), tuple(batch.kwargs[u] for u in order), labels)


def in_user_order(results: Mapping[int, Any], order: Sequence[int]) -> list[Any]:
    """Per-micro-batch ``results`` keyed by plan micro, listed in the user's micro-batch order."""
    out: list[Any] = [None] * len(order)
    for micro, user in enumerate(order):
        out[user] = results[micro]
    return out
