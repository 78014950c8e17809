"""Bounded compilations for batches whose shapes change: padding up to shape buckets.

In graph mode every new micro-batch shape compiles a new forward and backward graph per stage
(hundreds of milliseconds to seconds each). With ``shapes="buckets"`` and
``shape_buckets={dim: sizes}`` a schedule pads every positional input and every label along
``dim`` up to the smallest bucket size that holds it, with ``shape_pad_value``, before the batch
is cut into micro-batches; each kernel then compiles once per bucket at most. The loss learns
which positions are real through one mask per bucketed dim, appended after the labels:
``loss_fn(output, *labels, *masks)`` (``mask[b, i] = 1`` for ``i < length``, else 0; float32,
``[batch, bucket]``, cut into micro-batches like the labels). A masked loss (the per-token
``(Σ mask·loss, Σ mask)`` of ``loss_reduction="token"``, or a masked mean) then gives the
losses and gradients of the unpadded batch exactly where padding is neutral: a causal model
(position ``i`` never sees a later one) padded at the end. It is not neutral where the padded
positions reach the real ones: batch norm over the padded dim, mean or max pooling over it,
bidirectional attention without a mask (``docs/shapes.md``).

Everything is checked here before any rank communicates: the mode, the buckets (a dim >= 1,
sizes positive and strictly increasing), and at every ``run()`` that the padded tensors agree
on their length and that it fits the largest bucket.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The accepted ``shapes`` values.
SHAPES = ("static", "buckets", "dynamic")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShapeBuckets:
    """Bucket sizes per padded dim (dims ascending) and the pad value of inputs and labels."""

    buckets: tuple[tuple[int, tuple[int, ...]], ...]
    pad_value: int | float = 0

    def describe(self) -> str:
        """What every rank must share (compared at the first ``run()``)."""
        return f"buckets {dict(self.buckets)}, pad value {self.pad_value!r}"

    def bucket(self, dim: int, length: int, what: str) -> int:
        """The smallest bucket of ``dim`` that holds ``length``; a clear error beyond the largest."""
        sizes = dict(self.buckets)[dim]
        for size in sizes:
            if length <= size:
                return size
        raise ValueError(
            f"{what} has length {length} on dim {dim}, above the largest shape bucket {sizes[-1]} "
            f"(shape_buckets[{dim}] = {sizes}): add a larger bucket or shorten the batch"
        )

    def pad(self, inputs: Sequence[Any], labels: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``(padded inputs, (*padded labels, *masks))``: every input and label with more than
        ``dim`` dims padded at the end of each bucketed ``dim`` to its bucket; one float32
        ``[batch, bucket]`` mask per dim. ``labels``: a tensor, a tuple of them or ``None``."""
        import numpy as np

        label_list = (
            () if labels is None else tuple(labels) if isinstance(labels, tuple | list) else (labels,)
        )
        if not inputs:  # split_batch says what is missing
            return (), label_list
        named = [(f"input {i}", t) for i, t in enumerate(inputs)]
        named += [(f"label {i}", t) for i, t in enumerate(label_list)]
        for name, value in named:
            if not hasattr(value, "shape") or not hasattr(value, "ndim"):
                raise TypeError(
                    f"{name} must be a mindspore.Tensor or a numpy.ndarray, got {type(value).__name__}"
                )
        batch = int(named[0][1].shape[0]) if named and named[0][1].ndim else 0
        targets: dict[int, int] = {}
        masks = []
        for dim, _ in self.buckets:
            padded = [(name, t) for name, t in named if t.ndim > dim]
            if not padded:
                raise ValueError(
                    f"shape_buckets pads dim {dim}, but no input or label has {dim + 1} or more dims "
                    f"(shapes: {', '.join(f'{n} {list(t.shape)}' for n, t in named)})"
                )
            lengths = {name: int(t.shape[dim]) for name, t in padded}
            first, length = next(iter(lengths.items()))
            for name, other in lengths.items():
                if other != length:
                    raise ValueError(
                        f"{name} has length {other} on dim {dim} but {first} has {length}: every input "
                        f"and label with more than {dim} dims is padded along dim {dim}, so they must agree"
                    )
            targets[dim] = self.bucket(dim, length, first)
            mask = np.zeros((batch, targets[dim]), np.float32)
            mask[:, :length] = 1.0
            masks.append(mask)
        padded_inputs = tuple(self._pad_one(t, targets) for t in inputs)
        padded_labels = tuple(self._pad_one(t, targets) for t in label_list)
        return padded_inputs, (*padded_labels, *masks)

    def _pad_one(self, value: Any, targets: Mapping[int, int]) -> Any:
        """``value`` padded at the end of every dim in ``targets`` it has (itself when none grows)."""
        grow = {dim: size - int(value.shape[dim]) for dim, size in targets.items() if value.ndim > dim}
        if not any(grow.values()):
            return value
        import numpy as np

        if isinstance(value, np.ndarray):
            widths = [(0, grow.get(d, 0)) for d in range(value.ndim)]
            return np.pad(value, widths, constant_values=np.array(self.pad_value).astype(value.dtype))
        from mindspore import ops

        for dim, extra in sorted(grow.items()):
            if extra:
                shape = list(value.shape)
                shape[dim] = extra
                value = ops.cat((value, ops.full(tuple(shape), self.pad_value, dtype=value.dtype)), axis=dim)
        return value


def check_shapes(shapes: Any, shape_buckets: Any, pad_value: Any) -> ShapeBuckets | None:
    """The bucketing of a schedule (``None`` for ``"static"`` and ``"dynamic"``, which pad
    nothing), or a clear error naming the bad value and what is allowed."""
    if not isinstance(shapes, str) or shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(map(repr, SHAPES))}, got {shapes!r}")
    if isinstance(pad_value, bool) or not isinstance(pad_value, int | float):
        raise ValueError(f"shape_pad_value must be an int or a float, got {pad_value!r}")
    if shapes != "buckets":
        if shape_buckets is not None:
            raise ValueError(
                f"shape_buckets={shape_buckets!r} needs shapes='buckets' (shapes is {shapes!r}: nothing is padded)"
            )
        return None
    if not isinstance(shape_buckets, Mapping) or not shape_buckets:
        raise ValueError(
            "shapes='buckets' needs shape_buckets, a non-empty dict {dim: sizes}, e.g. "
            f"{{1: (64, 128, 256)}} for the sequence dim; got {shape_buckets!r}"
        )
    checked = []
    for dim, sizes in shape_buckets.items():
        if not _is_int(dim) or dim < 1:
            raise ValueError(
                f"shape_buckets dim must be an int >= 1 (dim 0 is the batch, cut into micro-batches), got {dim!r}"
            )
        if not isinstance(sizes, tuple | list) or not sizes or not all(_is_int(s) and s >= 1 for s in sizes):
            raise ValueError(
                f"shape_buckets[{dim}] must be a non-empty tuple of positive ints, got {sizes!r}"
            )
        if any(a >= b for a, b in itertools.pairwise(sizes)):
            raise ValueError(
                f"shape_buckets[{dim}] must be strictly increasing, got {tuple(sizes)}; "
                f"write {tuple(sorted(set(sizes)))}"
            )
        checked.append((dim, tuple(sizes)))
    return ShapeBuckets(tuple(sorted(checked)), pad_value)
