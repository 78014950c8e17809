"""Splitting a global batch into micro-batches, checked before any rank communicates."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


def _label_tuple(labels: Any) -> tuple[Any, ...]:
    """``labels`` as a tuple: one tensor, a tuple or list of them, or ``None`` (none)."""
    if labels is None:
        return ()
    return tuple(labels) if isinstance(labels, tuple | list) else (labels,)


def _converted(
    where: str, inputs: Sequence[Any], labels: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """``(inputs, labels)`` as ``mindspore.Tensor`` (labels as a tuple, ``None`` kept), each
    error naming the tensor with ``where`` in front (``""`` or ``"micro-batch 2 "``)."""
    tensors = tuple(_as_tensor(f"{where}input {i}", t) for i, t in enumerate(inputs))
    if labels is None:
        return tensors, None
    return tensors, tuple(_as_tensor(f"{where}label {i}", t) for i, t in enumerate(_label_tuple(labels)))


def _common_batch_size(named: Sequence[tuple[str, Any]]) -> tuple[str, int]:
    """``(first name, batch size)`` of tensors that must agree on dim 0; the error names both."""
    sizes = {name: _batch_size(name, t) for name, t in named}
    first_name, batch = next(iter(sizes.items()))
    for name, size in sizes.items():
        if size != batch:
            raise ValueError(
                f"{name} has batch size {size} but {first_name} has {batch}: all must match on dim 0"
            )
    return first_name, batch


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
    inputs, label_list = _converted("", inputs, labels)
    kwargs = {k: _as_tensor(f"keyword input {k!r}", t) for k, t in kwargs.items()}
    named = [(f"input {i}", t) for i, t in enumerate(inputs)] + [
        (f"keyword input {k!r}", t) for k, t in kwargs.items()
    ]
    named += [(f"label {i}", t) for i, t in enumerate(label_list or ())]
    first_name, batch = _common_batch_size(named)
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
        if label_list is None
        else tuple(zip(*(_chunks(t, micro_batch_num) for t in label_list), strict=True))
    )
    return MicroBatches(tuple(cut_inputs), tuple(cut_kwargs), cut_labels)


#: Pads one micro-batch's ``(inputs, labels)`` (``shapes="buckets"``) and returns both.
Pad = Callable[[Sequence[Any], Any], tuple[Sequence[Any], Any]]


def given_micro_batches(
    micro_batches: Any, micro_batch_num: int, *, labels_required: bool, pad: Pad | None = None
) -> MicroBatches:
    """The step's micro-batches as the caller made them (``run(micro_batches=...)``): each its
    own ``(inputs, labels)`` pair, so each can be padded to its own sizes only (a micro-batch of
    small images runs the tower at its own patch count, not the largest of the batch).

    Everything is checked before any rank communicates, each error naming the micro-batch and the
    value: exactly ``micro_batch_num`` pairs, each with a non-empty tuple of inputs that agree
    with its labels on dim 0; the same number of inputs and labels, each of the same dtype and
    rank, in every micro-batch (one compiled signature per shape, and the same messages on
    every rank); labels in every micro-batch or in none, and in every one where
    ``labels_required`` (a ``loss_fn``). Shapes beyond dim 0 may differ between micro-batches:
    that is the point. ``pad`` (bucketing) is applied to each micro-batch on its own.
    """
    entries = _entries(micro_batches, micro_batch_num)
    inputs, labels = [], []
    for m, entry in enumerate(entries):
        tensors, label_tuple = _one_micro_batch(m, entry, labels_required, pad)
        inputs.append(tensors)
        labels.append(label_tuple)
    _check_alike(inputs, labels)
    kwargs = tuple({} for _ in entries)
    return MicroBatches(tuple(inputs), kwargs, None if labels[0] is None else tuple(labels))


def _entries(micro_batches: Any, micro_batch_num: int) -> tuple[Any, ...]:
    """``micro_batches`` as a tuple of exactly ``micro_batch_num`` entries."""
    if isinstance(micro_batches, Mapping | str | bytes) or not isinstance(micro_batches, Sequence):
        raise ValueError(
            f"micro_batches must be a list of (inputs, labels) pairs, one per micro-batch, "
            f"got {type(micro_batches).__name__}"
        )
    if len(micro_batches) != micro_batch_num:
        raise ValueError(
            f"micro_batches has {len(micro_batches)} entries but micro_batch_num={micro_batch_num}: "
            f"pass exactly {micro_batch_num}"
        )
    return tuple(micro_batches)


def _one_micro_batch(
    m: int, entry: Any, labels_required: bool, pad: Pad | None
) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """Micro-batch ``m``'s converted ``(inputs, labels)``, padded by ``pad``, checked on dim 0."""
    if not isinstance(entry, tuple | list) or len(entry) != 2:
        raise ValueError(f"micro_batches[{m}] must be a pair (inputs, labels), got {_describe(entry)}")
    inputs, labels = entry
    if not isinstance(inputs, tuple | list) or not inputs:
        raise ValueError(
            f"micro_batches[{m}]: inputs must be a non-empty tuple of tensors, got {_describe(inputs)}"
        )
    if labels is None and labels_required:
        raise ValueError(
            f"micro_batches[{m}] has labels None, but labels are required: this schedule has a "
            "loss_fn, called as loss_fn(output, *labels)"
        )
    if pad is not None:
        try:
            inputs, labels = pad(inputs, labels)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"micro_batches[{m}]: {exc}") from None
    where = f"micro-batch {m} "
    tensors, label_tuple = _converted(where, inputs, labels)
    named = [(f"{where}input {i}", t) for i, t in enumerate(tensors)]
    named += [(f"{where}label {i}", t) for i, t in enumerate(label_tuple or ())]
    first_name, rows = _common_batch_size(named)
    if rows == 0:
        raise ValueError(
            f"micro-batch {m} is empty (0 rows on dim 0 of {first_name}): every micro-batch needs "
            "at least one row"
        )
    return tensors, label_tuple


def _check_alike(inputs: Sequence[tuple[Any, ...]], labels: Sequence[tuple[Any, ...] | None]) -> None:
    """Every micro-batch has micro-batch 0's number of inputs and labels, each of its dtype and
    rank (only the sizes may differ)."""
    for m in range(1, len(inputs)):
        if (labels[m] is None) != (labels[0] is None):
            has, lacks = (0, m) if labels[m] is None else (m, 0)
            raise ValueError(
                f"micro-batch {lacks} has no labels but micro-batch {has} has: pass labels in every "
                "micro-batch or in none"
            )
        for kind, mine, first in (("input", inputs[m], inputs[0]), ("label", labels[m], labels[0])):
            if mine is None:
                continue
            if len(mine) != len(first):
                raise ValueError(
                    f"micro-batch {m} has {len(mine)} {kind}s but micro-batch 0 has {len(first)}: "
                    "every micro-batch passes the same tensors"
                )
            for i, (a, b) in enumerate(zip(mine, first, strict=True)):
                if a.dtype != b.dtype or a.ndim != b.ndim:
                    raise ValueError(
                        f"micro-batch {m} {kind} {i} is {a.dtype} of shape {list(a.shape)} but "
                        f"micro-batch 0's is {b.dtype} of shape {list(b.shape)}: only the sizes may "
                        "differ between micro-batches"
                    )


def _describe(value: Any) -> str:
    """A short account of a bad value: its type, and its length where it has one."""
    kind = type(value).__name__
    if isinstance(value, tuple | list):
        return f"a {kind} of {len(value)}"
    return kind if hasattr(value, "shape") else f"{kind} {value!r:.60}"


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
