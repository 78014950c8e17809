"""The weight gradients of a chunk's linear layers, split off its backward (the zero-bubble ``W``).

Most of a transformer chunk's weight FLOPs are in its linear layers (``nn.Dense``,
``mint.nn.Linear``), and a linear layer's weight gradient needs only two tensors:
``dW = dzᵀ · x`` and ``db = Σ_rows dz``, with ``x`` the layer's input and ``dz`` the gradient at
its output (before any activation ``nn.Dense`` applies). So the split backward of the graph
executor works like the zero-bubble implementations do at their linear layers:

* the forward (:func:`make_probed_forward`) runs the chunk with each such layer *probed*: the
  layer saves its (2-D) input into a store ``Parameter`` and adds a zero probe ``Parameter`` to
  its output; the kernel returns copies of the stores beside the chunk's outputs;
* the input backward (``I``) differentiates that recorded forward with respect to the chunk's
  inputs, the probes and the chunk's *other* trainable parameters only: the gradient with
  respect to a probe is ``dz``, and with the linear weights left out MindSpore's dead-code
  elimination drops their weight matmuls from the bprop graph;
* the weight backward (``W``, :func:`make_linear_weight_grads`) is those matmuls and row sums,
  from the saved ``x`` and ``dz``: one compiled graph in graph mode, eager in pynative mode.

The probes and stores are ``Parameter``s, not kernel arguments: a sub-cell's ``construct`` takes
only what its parent passes it, and MindSpore's graph mode routes a tensor into a sub-cell, or
a value out of it, only through parameters (an attribute assigned to a tensor inside the
compiled function stays the constant it was at compile time: measured). They are shaped for one
input signature, made when it is first seen (the shapes come from one eager forward with the
layers counting their calls, :func:`trace_linear_calls`), and bound to that signature's graph.
They are never set as attributes the ``Cell`` registers, so they are in no one's
``trainable_params()`` or checkpoint. A layer is probed only while a probed kernel runs
(:func:`probed`): its class is swapped for a probing subclass and back.

A layer is split off only when that is exact: its weight (and bias) are trainable, belong to no
other cell (a tied weight keeps its gradient in ``I``) and it runs exactly once per forward
(a layer called twice would need one probe and one store per call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from mindspore import Parameter, Tensor, mint, nn, ops

from .autodiff import as_tuple

#: The layer types whose weight gradients :func:`make_linear_weight_grads` computes.
LINEAR_TYPES: tuple[type, ...] = (nn.Dense, mint.nn.Linear)

_STORE, _PROBE, _CALLS = "_ge_zb_store", "_ge_zb_probe", "_ge_zb_calls"


class _ProbedDense(nn.Dense):
    """``nn.Dense.construct`` with the input saved and the probe added before the activation."""

    def construct(self, x):
        x_shape = self.shape_op(x)
        if len(x_shape) != 2:
            x = self.reshape(x, (-1, x_shape[-1]))
        x = ops.depend(x, ops.assign(self._ge_zb_store, x))
        x = self.matmul(x, self.weight)
        if self.has_bias:
            x = self.bias_add(x, self.bias)
        x = x + self._ge_zb_probe
        if self.activation_flag:
            x = self.activation(x)
        if len(x_shape) != 2:
            out_shape = (*x_shape[:-1], ops.shape(x)[-1])
            x = self.reshape(x, out_shape)
        return x


class _ProbedLinear(mint.nn.Linear):
    """``mint.nn.Linear.construct`` with the input saved and the probe added."""

    def construct(self, x):
        x = ops.depend(x, ops.assign(self._ge_zb_store, x))
        return self.dense(x, self.weight, self.bias) + self._ge_zb_probe


class _CountingDense(nn.Dense):
    """Eager only: records the (2-D input, output) of every call."""

    def construct(self, x):
        flat = x if x.ndim == 2 else x.reshape((-1, x.shape[-1]))
        y = nn.Dense.construct(self, x)
        self._ge_zb_calls.append((flat, y.reshape((-1, y.shape[-1])) if y.ndim != 2 else y))
        return y


class _CountingLinear(mint.nn.Linear):
    """Eager only: records the (input, output) of every call."""

    def construct(self, x):
        y = mint.nn.Linear.construct(self, x)
        self._ge_zb_calls.append((x, y))
        return y


def _subclass(layer: nn.Cell, probing: bool) -> type:
    if isinstance(layer, nn.Dense):
        return _ProbedDense if probing else _CountingDense
    return _ProbedLinear if probing else _CountingLinear


def linear_candidates(cell: nn.Cell, trainable: Sequence[Parameter]) -> tuple[nn.Cell, ...]:
    """The linear layers of ``cell`` whose weight gradients can move to ``W``: exact types of
    :data:`LINEAR_TYPES` (a subclass may compute something else), weight and bias in
    ``trainable``, neither held by any other cell of ``cell``."""
    trainable_ids = {id(p) for p in trainable}
    holders: dict[int, int] = {}
    cells = [c for _, c in cell.cells_and_names()]
    for c in cells:
        for p in c._params.values():  # a cell's own parameters, not its children's
            holders[id(p)] = holders.get(id(p), 0) + 1
    found = []
    for c in cells:
        if type(c) not in LINEAR_TYPES:
            continue
        params = [c.weight] + ([c.bias] if c.bias is not None else [])
        if all(id(p) in trainable_ids and holders.get(id(p)) == 1 for p in params):
            found.append(c)
    return tuple(found)


@contextmanager
def _swapped(layers: Sequence[nn.Cell], probing: bool) -> Iterator[None]:
    originals = [type(layer) for layer in layers]
    try:
        for layer in layers:
            layer.__class__ = _subclass(layer, probing)
        yield
    finally:
        for layer, original in zip(layers, originals, strict=True):
            layer.__class__ = original


def trace_linear_calls(cell: nn.Cell, layers: Sequence[nn.Cell], inputs: Sequence[Tensor]) -> list[list]:
    """Run ``cell`` once eagerly, in evaluation mode (no running statistics move), and return
    for each layer the ``(input, output)`` pair (2-D) of each of its calls."""
    training = [(c, c.training) for _, c in cell.cells_and_names()]
    for layer in layers:
        object.__setattr__(layer, _CALLS, [])
    try:
        cell.set_train(False)
        with _swapped(layers, probing=False):
            cell(*inputs)
        return [getattr(layer, _CALLS) for layer in layers]
    finally:
        for c, flag in training:  # parents come first: a child's own flag wins
            c.set_train(flag)
        for layer in layers:
            object.__delattr__(layer, _CALLS)


@dataclass(frozen=True)
class LinearSplit:
    """The probed layers of one chunk and input signature, with their probes and stores.

    ``layers``: the split linear layers; ``probes[k]``: zero, shaped like layer ``k``'s 2-D
    output (``mint.nn.Linear``: its output); ``stores[k]``: shaped like its 2-D input;
    ``has_bias[k]``: whether ``W`` returns a bias gradient for it.
    """

    layers: tuple[nn.Cell, ...]
    probes: tuple[Parameter, ...]
    stores: tuple[Parameter, ...]
    has_bias: tuple[bool, ...]

    def params(self) -> list[Parameter]:
        """The layers' weights and biases in the order :func:`make_linear_weight_grads` returns
        their gradients."""
        return [
            p
            for layer in self.layers
            for p in ([layer.weight] + ([layer.bias] if layer.bias is not None else []))
        ]

    def saved_bytes(self) -> int:
        """Bytes saved between ``I`` and ``W`` per micro-batch: every layer's input and
        output gradient."""
        return sum(t.nbytes for t in (*self.probes, *self.stores))


def make_linear_split(
    cell: nn.Cell, trainable: Sequence[Parameter], inputs: Sequence[Tensor], name: str
) -> LinearSplit | None:
    """The :class:`LinearSplit` of ``cell`` for inputs shaped like ``inputs`` (``name``
    prefixes the probes' and stores' parameter names, unique per chunk and signature), or
    ``None`` when no layer qualifies."""
    candidates = linear_candidates(cell, trainable)
    if not candidates:
        return None
    calls = trace_linear_calls(cell, candidates, inputs)
    layers, probes, stores = [], [], []
    for index, (layer, seen) in enumerate(zip(candidates, calls, strict=True)):
        if len(seen) != 1:
            continue  # called twice (or never): its gradient stays in I
        x, y = seen[0]
        layers.append(layer)
        probes.append(Parameter(ops.zeros(y.shape, y.dtype), name=f"{name}.{index}.probe"))
        stores.append(
            Parameter(ops.zeros(x.shape, x.dtype), name=f"{name}.{index}.store", requires_grad=False)
        )
    if not layers:
        return None
    return LinearSplit(
        tuple(layers), tuple(probes), tuple(stores), tuple(layer.bias is not None for layer in layers)
    )


@contextmanager
def probed(split: LinearSplit) -> Iterator[None]:
    """Within: ``split``'s layers probe (save their input, add their probe); outside they are
    the user's layers again, attributes and class."""
    for layer, probe, store in zip(split.layers, split.probes, split.stores, strict=True):
        object.__setattr__(layer, _PROBE, probe)
        object.__setattr__(layer, _STORE, store)
    try:
        with _swapped(split.layers, probing=True):
            yield
    finally:
        for layer in split.layers:
            object.__delattr__(layer, _PROBE)
            object.__delattr__(layer, _STORE)


def make_probed_forward(cell: nn.Cell, split: LinearSplit) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs) -> (*outputs, *saved)``: the chunk's outputs, then a copy of each
    probed layer's input (no gradient flows into the copies). Run it within :func:`probed`."""
    stores = split.stores

    def probed_stage_forward(*inputs: Tensor) -> tuple[Tensor, ...]:
        outputs = as_tuple(cell(*inputs))
        saved = ()
        for store in stores:
            saved = (*saved, ops.stop_gradient(ops.deepcopy(store)))
        return outputs + saved

    return probed_stage_forward


def make_probed_loss(loss: Callable[..., object], split: LinearSplit) -> Callable[..., tuple[Tensor, ...]]:
    """``loss(*args) -> (*loss, *saved)``: the last stage's loss kernel (a scalar, or a per-token
    ``(sum, count)``) as a tuple, then a copy of each probed layer's input; the tape
    differentiates element 0. Run it within :func:`probed`."""
    stores = split.stores

    def probed_stage_loss(*args: Tensor) -> tuple[Tensor, ...]:
        value = loss(*args)
        head = value if isinstance(value, tuple) else (value,)
        saved = ()
        for store in stores:
            saved = (*saved, ops.stop_gradient(ops.deepcopy(store)))
        return head + saved

    return probed_stage_loss


def make_linear_weight_grads(has_bias: Sequence[bool]) -> Callable[..., tuple[Tensor, ...]]:
    """``W(*inputs, *output_grads) -> (dW_0, [db_0,] dW_1, ...)``: each layer's weight gradient
    ``dzᵀ · x`` (the product ``nn.Dense``'s own bprop takes: ``MatMul(transpose_a=True)``) and
    its bias gradient ``Σ_rows dz``, in :meth:`LinearSplit.params` order."""
    count = len(has_bias)
    biases = tuple(has_bias)
    matmul = ops.MatMul(transpose_a=True)
    row_sum = ops.ReduceSum(keep_dims=False)

    def linear_weight_grads(*tensors: Tensor) -> tuple[Tensor, ...]:
        grads = ()
        for k in range(count):
            x, dz = tensors[k], tensors[count + k]
            if x.ndim != 2:
                x = x.reshape((-1, x.shape[-1]))
                dz = dz.reshape((-1, dz.shape[-1]))
            grads = (*grads, matmul(dz, x))
            if biases[k]:
                grads = (*grads, row_sum(dz, 0))
        return grads

    return linear_weight_grads
