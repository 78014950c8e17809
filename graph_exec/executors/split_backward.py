"""The executor's half of the split backward (``body="zb"``): probed tapes, what ``I`` holds, ``W``.

``kernels.linear_split`` makes the probed chunk and the weight-gradient kernel; this module
keeps them per chunk and input signature and turns what an input backward returns into what
the weight backward adds:

* :class:`SplitTape`: a chunk's probed forward under the tape for one signature, with the order
  that puts the gradients of ``I`` and ``W`` back into the chunk's parameter order;
* :class:`SplitTapes`: those tapes by signature, at most ``size`` of them (the kernel cache's
  size), the least recently used dropped first. Each holds its probes, stores, call counters
  and zero upstream gradients (the zb buffers, :attr:`SplitTapes.nbytes`: one layer input and
  one layer output per split layer, per signature); a signature with nothing to split is
  remembered as ``None`` within the same bound. A new signature costs one eager forward and
  backward of the chunk (the trace) before its probed forward is made;
* :class:`LinearWork`: what ``I`` leaves for ``W`` — the split layers' inputs and output
  gradients, the forward's call counts, and the gradients of every other trainable parameter
  (those of layers left whole included), computed by ``I``;
* :func:`weight_gradients`: ``W`` itself, with the call counts checked first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from graph_exec.kernels.linear_split import (
    LinearSplit,
    check_call_counts,
    make_linear_split,
    make_linear_weight_grads,
    make_probed_forward,
    make_probed_loss,
    probed,
)

from .tape import Tape

Tensors = tuple[Tensor, ...]

#: Process-wide numbering of split tapes: their probes' and stores' parameter names are unique.
_split_numbers = itertools.count()


class SplitTape:
    """A chunk's probed forward under the tape, for one input signature.

    The tape differentiates with respect to the inputs, the probes and ``small`` (the stage's
    trainable parameters that are not in a split linear layer), so its bprop computes no split
    layer's weight gradient. ``order[i]``: where the gradient of the stage's ``i``-th trainable
    parameter is in ``(*small gradients, *W's gradients)``; ``key``: the cache key of this
    signature's ``W`` kernel. Calling it runs the forward with the layers probed; its outputs
    end with the saved layer inputs and the call counts (:attr:`saved_count` of them).
    """

    def __init__(
        self, tape: Tape, split: LinearSplit, small: ParameterTuple, order: tuple[int, ...], key: Hashable
    ) -> None:
        self.tape, self.split, self.small, self.order, self.key = tape, split, small, order, key
        #: The upstream gradient of the saved copies and the counts: zeros, never written.
        self.saved_sens = (
            *(ops.zeros(s.shape, s.dtype) for s in split.stores),
            ops.zeros((len(split.counts),), split.counts[0].dtype),
        )
        self.saved_count = len(self.saved_sens)
        self.ran = False  #: whether the probed forward ran once (compiled, in graph mode)

    def __call__(self, *args: Any) -> Any:
        with probed(self.split):
            return self.tape(*args)

    @property
    def nbytes(self) -> int:
        """The zb buffers this signature holds while cached."""
        return self.split.nbytes() + sum(int(t.nbytes) for t in self.saved_sens)


class SplitTapes:
    """:class:`SplitTape` (or ``None``: nothing to split) by key, least recently used out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, SplitTape | None] = OrderedDict()
        self.nbytes = 0  #: the zb buffers of the cached tapes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> SplitTape | None:
        """The entry under ``key`` (now the most recently used); ``None`` also when absent."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, tape: SplitTape | None) -> SplitTape | None:
        self._drop(key)
        self._entries[key] = tape
        self.nbytes += tape.nbytes if tape is not None else 0
        while len(self._entries) > self.size:
            self._drop(next(iter(self._entries)))
        return tape

    def _drop(self, key: Hashable) -> None:
        tape = self._entries.pop(key, None)
        self.nbytes -= tape.nbytes if tape is not None else 0

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def make_split_tape(
    cell: nn.Cell,
    params: Sequence[Parameter],
    inputs: Tensors,
    grad_inputs: bool,
    prepare: Callable[[Callable[..., Any]], Callable[..., Any]],
    weight_key: Hashable,
    make_loss: Callable[[], Callable[..., Any]] | None = None,
) -> SplitTape | None:
    """The :class:`SplitTape` of ``cell`` (trainable ``params``) for inputs shaped like
    ``inputs``: the stage forward's, or with ``make_loss`` the last stage's loss step's; ``None``
    when no layer can be split exactly (one eager trace of the chunk decides)."""
    split = make_linear_split(cell, params, inputs, f"ge_zb.{weight_key[1]}.{next(_split_numbers)}")
    if split is None:
        return None
    in_layer = {id(p): i for i, p in enumerate(split.params())}
    small = [p for p in params if id(p) not in in_layer]
    at_small = {id(p): i for i, p in enumerate(small)}
    order = tuple(at_small[id(p)] if id(p) in at_small else len(small) + in_layer[id(p)] for p in params)
    weights = ParameterTuple([*split.probes, *small])
    if make_loss is None:
        tape = Tape(make_probed_forward(cell, split), weights, grad_inputs, prepare)
    else:
        tape = Tape(
            make_probed_loss(make_loss(), split), weights, grad_inputs, prepare, differentiated_output=0
        )
    return SplitTape(tape, split, ParameterTuple(small), order, weight_key)


@dataclass(frozen=True)
class LinearWork:
    """What ``I`` leaves for ``W``: the split layers' inputs, their call counts and output
    gradients, and the gradients of the stage's other trainable parameters (computed in ``I``)."""

    split: SplitTape
    saved: Tensors
    counts: Tensor
    output_grads: Tensors
    small_grads: Tensors

    @classmethod
    def of(cls, split: SplitTape, saved: Tensors, grads: Tensors) -> LinearWork:
        """From the probed forward's saved outputs (inputs, then counts) and ``I``'s weight
        gradients (probes first, then ``small``)."""
        probes = len(split.split.probes)
        return cls(split, tuple(saved[:-1]), saved[-1], tuple(grads[:probes]), tuple(grads[probes:]))

    @property
    def nbytes(self) -> int:
        """What is held between ``I`` and ``W``, from the tensors' shapes (the memory accounting
        reads it as it reads a tensor's)."""
        held = (*self.saved, self.counts, *self.output_grads, *self.small_grads)
        return sum(int(t.nbytes) for t in held if t is not None)


def weight_gradients(work: LinearWork, call: Callable[..., Any], prepare: Callable[..., Any]) -> tuple:
    """``W``: every trainable parameter's gradient in the stage's order — the split layers'
    from their inputs and output gradients (one kernel cached under ``work.split.key``, run by
    ``call(key, make, *args)``), the others as ``I`` computed them. The forward's call counts
    are checked first (a split layer run twice is an error naming it)."""
    split = work.split.split
    check_call_counts(split, work.counts)
    layer_grads = call(
        work.split.key,
        lambda: prepare(
            make_linear_weight_grads(split.has_bias, split.compute_dtypes(), split.param_dtypes())
        ),
        *work.saved,
        *work.output_grads,
    )
    every = (*work.small_grads, *layer_grads)
    return tuple(every[i] for i in work.split.order)
