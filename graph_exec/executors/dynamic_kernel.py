"""A compiled kernel for ``shapes="dynamic"``: two compilations, whatever the sizes.

``mindspore.jit(dynamic=1)`` compiles a static graph for each of the first two distinct shapes
and a dynamic-shape graph at the third: three compilations per kernel (measured with MindSpore
2.10, ``docs/shapes.md``). :class:`GeneralisingKernel` compiles its first shape as a static graph
(the fastest to run: a length seen first keeps the static speed) and, at the first call with
other sizes, one graph in which every dim that differed is dynamic: ``mindspore.enable_dynamic``
declares the dims of one argument, so the arguments travel as one ``mindspore.mutable`` tuple
(measured: gradients through it under the autograd tape are exact). Later calls go to the graph
whose dims fit; a dim that starts to vary only later generalises the dynamic graph once more.

A dynamic-shape graph runs slower than a static one (1.6-2.5x on CPU, measured), so a shape
that keeps coming back is given a static graph of its own: in the :data:`HOT_AFTER`-th step
that calls the kernel with it (steps, not calls: every micro-batch of a step has the step's
shapes), at most :data:`MAX_HOT_SHAPES` shapes per kernel. Lengths drawn anew every step never
get there (two compilations per kernel); a job that settles on a few lengths runs them at
static speed after a third compilation each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
from mindspore import Tensor

#: In how many steps a shape is seen before it gets a static graph (the first shape: at once).
HOT_AFTER = 3
#: Static graphs per kernel besides the first shape's.
MAX_HOT_SHAPES = 8

#: Per argument: its shape with ``None`` for a dynamic dim, or ``None`` for a dynamic rank.
Pattern = tuple[tuple[int | None, ...] | None, ...]


def generalised(pattern: Pattern, shapes: Sequence[tuple[int, ...]]) -> Pattern:
    """``pattern`` with ``None`` wherever ``shapes`` differ from it (a dynamic rank where the
    number of dims differs)."""
    merged = []
    for known, shape in zip(pattern, shapes, strict=True):
        if known is None or len(known) != len(shape):
            merged.append(None)
        else:
            merged.append(tuple(k if k == s else None for k, s in zip(known, shape, strict=True)))
    return tuple(merged)


def fits(pattern: Pattern, shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether arguments of ``shapes`` fit the graph compiled for ``pattern``."""
    for known, shape in zip(pattern, shapes, strict=True):
        if known is None:
            continue
        if len(known) != len(shape) or any(
            k is not None and k != s for k, s in zip(known, shape, strict=True)
        ):
            return False
    return True


class GeneralisingKernel:
    """``kernel`` compiled as a static graph for its first shapes (and hot ones) and one
    dynamic-shape graph for every other size (see the module docstring). ``clock()``: the
    number of steps begun. Arguments must be tensors."""

    def __init__(self, kernel: Callable[..., Any], clock: Callable[[], int]) -> None:
        self._kernel = kernel
        self._clock = clock  # the executor's step count
        self._static = ms.jit(kernel)  # one static graph per shape it is called with
        self._static_shapes: set[tuple[tuple[int, ...], ...]] = set()
        #: Shapes without a static graph: (steps that called with them, the last such step).
        self._seen: dict[tuple[tuple[int, ...], ...], tuple[int, int]] = {}
        self._pattern: Pattern | None = None
        self._dynamic: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if not all(isinstance(a, Tensor) for a in args):
            raise TypeError(
                f"a dynamic-shape kernel takes tensors only, got {[type(a).__name__ for a in args]}"
            )
        shapes = tuple(tuple(a.shape) for a in args)
        now = self._clock()
        steps, last = self._seen.get(shapes, (0, None))
        if shapes not in self._static_shapes and last != now:
            steps += 1
            if not self._static_shapes:  # the first shape
                self._pattern = shapes
                self._static_shapes.add(shapes)
            elif steps >= HOT_AFTER and len(self._static_shapes) <= MAX_HOT_SHAPES:
                self._static_shapes.add(shapes)
                self._seen.pop(shapes, None)
            else:
                self._seen[shapes] = (steps, now)
        if shapes in self._static_shapes:
            return self._static(*args)
        if not fits(self._pattern, shapes):
            self._pattern = generalised(self._pattern, shapes)
            self._dynamic = self._compile(self._pattern, args)
        return self._dynamic(ms.mutable(tuple(args)))

    def _compile(self, pattern: Pattern, args: Sequence[Tensor]) -> Callable[..., Any]:
        kernel = self._kernel

        def packed(args: tuple) -> Any:
            return kernel(*args)

        packed.__name__ = packed.__qualname__ = f"{kernel.__name__}_dynamic"
        declared = tuple(
            Tensor(shape=None if dims is None else list(dims), dtype=a.dtype)
            for dims, a in zip(pattern, args, strict=True)
        )
        return ms.enable_dynamic(args=declared)(ms.jit(packed))
