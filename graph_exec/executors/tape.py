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

A forward that kept only its inputs (``recompute=True``, the preprocess backward) is not
recorded and then differentiated: :meth:`Tape.recompute` runs forward and gradient in one go,
``GradOperation`` inside the function that ``prepare`` turns into one compiled graph in graph
mode (eager in pynative mode). Against recording the jitted chunk and running its bprop, p50 of
one call (``python -m graph_exec.benchmarks.executor_speed --only recompute``, two runs, MindSpore
2.10 on CPU, same gradients bit for bit): the ``embed_lm`` preprocess (embedding and one block,
32 wide, 2x32 tokens) 4.5-7.0 against 7.2-11.1 ms (1.57-1.63x), eight Dense+Tanh layers 32 wide
on 4 rows 2.1-2.8 against 3.7-4.8 ms (1.63-1.78x), idle or with taped forwards of another chunk
in flight.

The last stage's loss is run and differentiated at once, so it is not recorded either:
:meth:`Tape.value_and_gradient` returns the loss and its gradients from one call. Its loss
scale is a tensor argument of that call, not a constant of the graph: a dynamic loss scaler
changes it from step to step without a recompilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
from mindspore import ParameterTuple, nn, ops

#: What :meth:`Tape.value_and_gradient` raises (from inside the graph in graph mode) when a
#: kernel with a ``differentiated_output`` returns a single tensor instead of a tuple, and when
#: one without returns a tuple; every recorded forward of the process is forgotten then
#: (:func:`free_tapes`), since the failed graph leaves MindSpore's autograd state unusable.
NOT_A_TUPLE = "the kernel returned one tensor where a tuple was expected (differentiated_output is set)"
A_TUPLE = "the kernel returned a tuple where one tensor was expected (differentiated_output is None)"


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

    ``kernel`` is the plain function; ``prepare`` turns a function into what runs it (compiled
    with ``mindspore.jit`` in graph mode, as is in pynative mode) and is applied to the recorded
    forward and, on first use, to the one-call functions of :meth:`recompute` and
    :meth:`value_and_gradient`. ``grad_inputs``: whether input gradients are wanted
    (``GradOperation`` then returns one per positional argument; the caller keeps those it
    needs). At least one of the two kinds of gradient must be wanted, or there is nothing to
    record. ``differentiated_output``: for :meth:`value_and_gradient` of a kernel that returns
    a tuple, the position of the one element that is differentiated (the sum of a per-token
    loss beside its token count); ``None``: the kernel's output is the scalar itself.
    ``dynamic_shapes``: ``prepare`` compiles for dynamic shapes (a static graph for the first
    shape, one dynamic-shape graph for every other size: ``executors/dynamic_kernel.py``), so
    :meth:`recompute` differentiates ``Σ sum(output * cotangent)`` with the cotangents as
    ordinary inputs instead of passing them as ``GradOperation``'s sens (same gradients):
    MindSpore refuses a sens of dynamic shape ("The shape of sense must not be dynamic shape",
    measured with the ``jit(dynamic=1)`` used before, at its first dynamic-shape graph); and
    :meth:`value_and_gradient` takes its scale as a ``[1]`` tensor: that automatic dynamic shape
    gave up on a function with a 0-d tensor argument (``_is_invalid_shape`` in MindSpore 2.10)
    and compiled it for every length (``docs/shapes.md``).
    """

    def __init__(
        self,
        kernel: Callable[..., Any],
        weights: ParameterTuple,
        grad_inputs: bool,
        prepare: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda kernel: kernel,
        differentiated_output: int | None = None,
        dynamic_shapes: bool = False,
    ) -> None:
        if not grad_inputs and not len(weights):
            raise ValueError("a tape needs input gradients or weights to differentiate")
        self.kernel = prepare(kernel)
        self._raw_kernel = kernel
        self._weights = weights
        self._prepare = prepare
        self._inputs = grad_inputs
        self._cell = _TapeCell(self.kernel)
        self._grad = self._grad_operation(self._cell)
        self._one_go: Callable[..., Any] | None = None
        self._value_and_gradient: Callable[..., Any] | None = None
        self._differentiated = differentiated_output
        self._dynamic = dynamic_shapes

    def _grad_operation(self, cell: nn.Cell) -> Callable[..., Any]:
        """``GradOperation`` over ``cell`` for the gradients this tape returns (sens last)."""
        if self._inputs and len(self._weights):
            return ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(cell, self._weights)
        if self._inputs:
            return ops.GradOperation(get_all=True, sens_param=True)(cell)
        return ops.GradOperation(get_by_list=True, sens_param=True)(cell, self._weights)

    def __call__(self, *args: Any) -> Any:
        """Run and record the forward."""
        return self._cell(*args)

    def backward(self, args: tuple[Any, ...], sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``(input grads, weight grads)`` of the forward recorded for ``args`` with upstream
        gradient ``sens`` (shaped like the kernel's output); either part is ``()`` when not
        asked for. The recorded forward is consumed."""
        return self._split(self._grad(*args, sens))

    def recompute(self, args: tuple[Any, ...], sens: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """What :meth:`backward` returns, for a forward that was not recorded: the forward runs
        again and is differentiated in the same call (see the module docstring). Nothing is
        recorded, so nothing is left behind."""
        tupled = isinstance(sens, tuple)
        if self._one_go is None and self._dynamic:
            self._one_go = self._prepare(self._loss_form(len(args), tupled))
        if self._one_go is None:
            # Its own cell: recorded forwards of this tape may be in flight on ``self._cell``.
            grad = self._grad_operation(_TapeCell(self._raw_kernel))
            count = len(args)  # fixed: a tape serves one input signature

            # Every tensor is a positional argument: a tuple argument to a compiled function
            # counts as a constant, and the graph would compile again at every call (measured).
            def forward_and_gradient(*tensors: Any) -> Any:
                cotangents = tensors[count:]
                return grad(*tensors[:count], cotangents if tupled else cotangents[0])

            self._one_go = self._prepare(forward_and_gradient)
        return self._split(self._one_go(*args, *(sens if tupled else (sens,))))

    def _loss_form(self, count: int, tupled: bool) -> Callable[..., Any]:
        """``(*inputs, *cotangents) -> gradients`` of ``Σ sum(output_i * cotangent_i)``: what
        :meth:`recompute` runs when the cotangents may not be a sens input."""
        kernel = self._raw_kernel
        positions = tuple(range(count)) if self._inputs else None
        weights = self._weights if len(self._weights) else None

        def objective(*tensors: Any) -> Any:
            outputs = kernel(*tensors[:count])
            outputs = outputs if tupled else (outputs,)
            cotangents = tensors[count:]
            total = (outputs[0] * cotangents[0]).sum()
            for i in range(1, len(outputs)):  # jit parses no zip(..., strict=...)
                total = total + (outputs[i] * cotangents[i]).sum()
            return total

        gradient = ms.grad(objective, positions, weights)

        def forward_and_gradient(*tensors: Any) -> Any:
            return gradient(*tensors)

        return forward_and_gradient

    def value_and_gradient(self, args: tuple[Any, ...], scale: Any) -> tuple[Any, tuple[tuple, tuple]]:
        """The kernel's output and the gradients :meth:`backward` would return for upstream
        gradient ``scale`` (a scalar float32 ``Tensor``), in one call (one compiled graph in
        graph mode), for a kernel run once and differentiated at once (the last stage's loss).
        Nothing is recorded.

        The graph differentiates ``output * scale`` (the ``differentiated_output`` element of
        a tuple output) and returns the output beside it: the product's backward hands
        ``scale`` on unchanged, so the gradients equal the recorded bprop's with
        ``sens = scale`` bit for bit (tested). ``scale`` is the graph's last argument, so a new
        value runs the same compiled graph.
        """
        if self._value_and_gradient is None:
            count = len(args)
            positions = tuple(range(count)) if self._inputs else None
            weights = self._weights if len(self._weights) else None
            kernel, element = self._raw_kernel, self._differentiated

            # The scale is an argument but not differentiated: positions name the kernel's own.
            def scaled(*tensors: Any) -> tuple[Any, Any]:
                output = kernel(*tensors[:count])
                factor = tensors[count].reshape(())  # a [1] tensor with dynamic shapes
                if element is None:
                    if isinstance(output, tuple):
                        raise ValueError(A_TUPLE)
                    return output * factor, output
                if not isinstance(output, tuple):
                    raise ValueError(NOT_A_TUPLE)
                return output[element] * factor, output

            differentiate = ms.value_and_grad(scaled, positions, weights, has_aux=True)

            def value_and_gradient(*tensors: Any) -> Any:
                (_, output), grads = differentiate(*tensors)
                return output, grads

            self._value_and_gradient = self._prepare(value_and_gradient)
        try:
            output, grads = self._value_and_gradient(*args, scale.reshape((1,)) if self._dynamic else scale)
        except ValueError as exc:
            mismatch = next((text for text in (NOT_A_TUPLE, A_TUPLE) if text in str(exc)), None)
            if mismatch is None:
                raise
            # An error raised inside a differentiated graph leaves MindSpore's autograd state
            # broken for later graphs (seen: a null-pointer bprop error in the next test).
            free_tapes()
            raise ValueError(mismatch) from None
        return output, self._split(grads)

    def _split(self, grads: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if self._inputs and len(self._weights):
            return tuple(grads[0]), tuple(grads[1])
        if self._inputs:
            return tuple(grads), ()
        return (), tuple(grads)


def free_tapes() -> None:
    """Forget every recorded forward of this process (see the module docstring)."""
    from mindspore.common.api import _pynative_executor

    _pynative_executor.clear_res()
