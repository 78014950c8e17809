"""A kernel run under MindSpore's autograd tape, differentiated later with its recorded bprop.

A :class:`Tape` wraps a kernel (the ``mindspore.jit``-compiled chunk in graph mode, the eager
chunk in pynative mode) in a ``Cell`` with ``set_grad(True)``. Calling it records the forward;
:meth:`Tape.backward` with the *same input tensor objects* then runs
``GradOperation(..., sens_param=True)``, which finds the recorded forward instead of running it
again. For a jitted kernel MindSpore compiles a forward graph that also returns what the bprop
graph needs, and a bprop graph that consumes it: nothing is recomputed, and the gradients are
bit-identical to ``mindspore.value_and_grad`` (measured with MindSpore 2.10 on CPU). Several
forwards of one tape may be in flight and their backwards may run in any order.

The wrapper stores the kernel *function*, never the user's cell: assigning a cell as an
attribute of another cell renames its parameters for every later user.

A recorded forward whose backward never runs stays in MindSpore's pynative state (measured:
memory grows with every abandoned forward). The executors therefore consume a forward they drop
(an aborted step) with a backward of zero upstream gradients whose results they discard. As a
last resort :func:`free_tapes` releases every recorded forward of the process: it also forgets
other executors' in-flight forwards (their backward then records its forward again from the
kept inputs, with the same numbers), and the next taped calls are slower while MindSpore sets
itself up again (measured: tens of milliseconds for a small chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import ParameterTuple, nn, ops


class _TapeCell(nn.Cell):
    """The top cell MindSpore records: it only calls the kernel function it holds."""

    def __init__(self, kernel: Callable[..., Any]) -> None:
        super().__init__(auto_prefix=False)
        self.kernel = kernel
        self.set_grad(True)

    def construct(self, *args: Any) -> Any:
        return self.kernel(*args)


class Tape:
    """``kernel`` under the autograd tape, with gradients for some inputs and ``weights``.

    ``grad_inputs``: whether input gradients are wanted (``GradOperation`` then returns one
    per positional argument; the caller keeps those it needs). At least one of the two kinds of
    gradient must be wanted, or there is nothing to record.
    """

    def __init__(self, kernel: Callable[..., Any], weights: ParameterTuple, grad_inputs: bool) -> None:
        if not grad_inputs and not len(weights):
            raise ValueError("a tape needs input gradients or weights to differentiate")
        self.kernel = kernel
        self._cell = _TapeCell(kernel)
        self._inputs = grad_inputs
        self._weights = len(weights) > 0
        if grad_inputs and self._weights:
            self._grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(
                self._cell, weights
            )
        elif grad_inputs:
            self._grad = ops.GradOperation(get_all=True, sens_param=True)(self._cell)
        else:
            self._grad = ops.GradOperation(get_by_list=True, sens_param=True)(self._cell, weights)

    def __call__(self, *args: Any) -> Any:
        """Run and record the forward."""
        return self._cell(*args)

    def backward(self, args: tuple[Any, ...], sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``(input grads, weight grads)`` of the forward recorded for ``args`` with upstream
        gradient ``sens`` (shaped like the kernel's output); either part is ``()`` when not
        asked for. The recorded forward is consumed."""
        grads = self._grad(*args, sens)
        if self._inputs and self._weights:
            return tuple(grads[0]), tuple(grads[1])
        if self._inputs:
            return tuple(grads), ()
        return (), tuple(grads)


def free_tapes() -> None:
    """Forget every recorded forward of this process (see the module docstring)."""
    from mindspore.common.api import _pynative_executor

    _pynative_executor.clear_res()
