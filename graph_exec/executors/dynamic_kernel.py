"""A compiled kernel for ``shapes="dynamic"``: two compilations, whatever the sizes.

``mindspore.jit(dynamic=1)`` compiles a static graph for each of the first two distinct shapes
and a dynamic-shape graph at the third: three compilations per kernel (measured with MindSpore
2.10, ``docs/shapes.md``), so it is not used. :class:`GeneralisingKernel` compiles its first shape as a static graph
(the fastest to run: a length seen first keeps the static speed) and, at the first call with
other sizes, one graph in which every dim that differed is dynamic: ``mindspore.enable_dynamic``
declares them per argument, the arguments staying flat and positional (a ``mindspore.mutable``
tuple of them gives wrong weight gradients under the autograd tape: :meth:`GeneralisingKernel._compile`).
Later calls go to the graph whose dims fit; a dim that starts to vary only later generalises the
dynamic graph once more.

A dynamic-shape graph runs slower than a static one (1.6-2.5x on CPU, measured), so a shape
that keeps coming back is given a static graph of its own: in the :data:`HOT_AFTER`-th step
that calls the kernel with it (steps, not calls: every micro-batch of a step has the step's
shapes), at most :data:`MAX_HOT_SHAPES` shapes per kernel. Lengths drawn anew every step never
get there (two compilations per kernel); a job that settles on a few lengths runs them at
static speed after a third compilation each.

How often each shape without a static graph came back is counted for at most
:data:`MAX_COUNTED_SHAPES` shapes, the one seen longest ago forgotten first: lengths drawn anew
every step would otherwise grow the count by one entry per distinct shape for the whole job. A
shape that keeps coming back is seen again before that many other shapes, so it still becomes
hot; once the kernel has all its hot graphs nothing is counted any more.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mindspore as ms
from mindspore import Tensor

from .jit_options import compile_function

#: In how many steps a shape is seen before it gets a static graph (the first shape: at once).
HOT_AFTER = 3
#: Static graphs per kernel besides the first shape's.
MAX_HOT_SHAPES = 8
#: Shapes without a static graph whose steps are counted at once (least recently seen dropped).
MAX_COUNTED_SHAPES = 64

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
    number of steps begun; ``jit_options``: what every ``mindspore.jit`` of it is given.
    Arguments must be tensors."""

    def __init__(
        self,
        kernel: Callable[..., Any],
        clock: Callable[[], int],
        jit_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._kernel = kernel
        self._clock = clock  # the executor's step count
        self._jit_options = dict(jit_options or {})
        self._static = compile_function(kernel, self._jit_options)  # a static graph per shape called with
        self._static_shapes: set[tuple[tuple[int, ...], ...]] = set()
        #: Shapes without a static graph: (steps that called with them, the last such step), the
        #: least recently seen first, at most MAX_COUNTED_SHAPES (module docstring).
        self._seen: OrderedDict[tuple[tuple[int, ...], ...], tuple[int, int]] = OrderedDict()
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
            elif steps >= HOT_AFTER and self._hot_left():
                self._static_shapes.add(shapes)
                self._seen.pop(shapes, None)
                if not self._hot_left():
                    self._seen.clear()  # no static graph left to give: stop counting
            elif self._hot_left():
                self._count(shapes, steps, now)
        if shapes in self._static_shapes:
            return self._static(*args)
        if not fits(self._pattern, shapes):
            self._pattern = generalised(self._pattern, shapes)
            self._dynamic = self._compile(self._pattern, args)
        return self._dynamic(*args)

    def _hot_left(self) -> bool:
        """Whether a hot shape may still get a static graph of its own."""
        return len(self._static_shapes) <= MAX_HOT_SHAPES

    def _count(self, shapes: tuple[tuple[int, ...], ...], steps: int, now: int) -> None:
        """Record ``shapes`` as seen in ``steps`` steps, the latest ``now``; forget the shape
        seen longest ago beyond :data:`MAX_COUNTED_SHAPES`."""
        self._seen[shapes] = (steps, now)
        self._seen.move_to_end(shapes)
        while len(self._seen) > MAX_COUNTED_SHAPES:
            self._seen.popitem(last=False)

    def _compile(self, pattern: Pattern, args: Sequence[Tensor]) -> Callable[..., Any]:
        """The dynamic-shape graph of ``pattern``, taking the arguments flat and positional.

        ``mindspore.enable_dynamic`` declares arguments by parameter name, and the kernels take
        ``*args``; so the jitted function is given a signature naming each position (``a0``,
        ``a1``, ...: ``enable_dynamic`` reads ``inspect.signature`` and keeps the position of
        each name) and only the arguments with a dynamic dim are declared.

        Not a ``mindspore.mutable`` tuple of the arguments, which is what this used to pass:
        with MindSpore 2.10 a jitted function called under the autograd tape with a mutable tuple
        of two or more tensors returns wrong *weight* gradients from its recorded bprop, the
        input gradients staying exact (measured on CPU, static or dynamic graph alike: with
        input gradients asked for, the bias gradient of ``dense(h) + g`` is exact at the first
        call and zero at every later call of the compiled graph; without them, every weight
        gradient is zero from the first call). A static graph is compiled anew per shape, so it
        hid the fault; the one dynamic graph is called again and again, so stage 0 after a
        two-output preprocess got a zero bias gradient from the second batch size on.
        Flat arguments are exact in every case (``tests/kernels/test_dynamic_kernel.py``).
        """
        kernel = self._kernel

        def flat(*args: Tensor) -> Any:
            return kernel(*args)

        flat.__name__ = flat.__qualname__ = f"{kernel.__name__}_dynamic"
        names = [f"a{i}" for i in range(len(args))]
        flat.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in names]
        )
        declared = {
            name: Tensor(shape=None if dims is None else list(dims), dtype=a.dtype)
            for name, dims, a in zip(names, pattern, args, strict=True)
            if dims is None or None in dims
        }
        return ms.enable_dynamic(**declared)(compile_function(flat, self._jit_options))
