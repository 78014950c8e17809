"""The weight gradients of a chunk's linear layers, split off its backward (the zero-bubble ``W``).

Most of a transformer chunk's weight FLOPs are in its linear layers (``nn.Dense``,
``mint.nn.Linear``), and a linear layer's weight gradient needs only two tensors:
``dW = dzᵀ · x`` and ``db = Σ_rows dz``, with ``x`` the layer's input and ``dz`` the gradient at
its output (before any activation ``nn.Dense`` applies). So the split backward of the graph
executor works like the zero-bubble implementations do at their linear layers:

* the forward (:func:`make_probed_forward`) runs the chunk with each such layer *probed*: the
  layer saves its (2-D) input into a store ``Parameter``, adds a zero probe ``Parameter`` to
  its output and counts its calls; the kernel returns copies of the stores and the counts
  beside the chunk's outputs;
* the input backward (``I``) differentiates that recorded forward with respect to the chunk's
  inputs, the probes and the chunk's *other* trainable parameters only: the gradient with
  respect to a probe is ``dz``, and with the linear weights left out MindSpore's dead-code
  elimination drops their weight matmuls from the bprop graph;
* the weight backward (``W``, :func:`make_linear_weight_grads`) is those matmuls and row sums,
  from the saved ``x`` and ``dz``, in the dtype the layer computed in (a float16 layer of a
  float32 model: ``Cell.to_float``, ``amp.auto_mixed_precision``) and cast to its weight's
  dtype, as the layer's own bprop does: one compiled graph in graph mode, eager in pynative.

The probes and stores are ``Parameter``s, not kernel arguments: a sub-cell's ``construct`` takes
only what its parent passes it, and MindSpore's graph mode routes a tensor into a sub-cell, or
a value out of it, only through parameters (an attribute assigned to a tensor inside the
compiled function stays the constant it was at compile time: measured). They are shaped for one
input signature, made when it is first seen (the shapes come from one eager forward and
backward, :func:`trace_linear_calls`), and bound to that signature's graph. They are never set
as attributes the ``Cell`` registers, so they are in no one's ``trainable_params()`` or
checkpoint. A layer is probed only while a probed kernel runs (:func:`probed`): its class is
swapped for a probing subclass and back.

A layer is split off only when that is provably exact; otherwise it is left whole (its weight
gradient comes from ``I``'s own backward), and :func:`make_linear_split` says why per layer:

* its weight (and bias) are trainable and registered by no other cell (a tied weight);
* nothing else reads them: the trace runs the layer on a stand-in copy of its weight and bias
  and differentiates the chunk with respect to the real ones, so any other use (a parent's
  ``ops.matmul(x, self.a.weight.T)``, a tied decoder) shows as a nonzero gradient;
* it runs exactly once per forward, counted in the mode the run uses (the cells' own training
  flags; dropout cells are run as in evaluation, the default random generator and every
  non-trainable parameter, e.g. batch-norm statistics, are put back after the trace), and
  counted again by every probed forward: :func:`check_call_counts` refuses a run that called a
  split layer more than once;
* it has no hook (forward, backward, or on its weight or bias): a hook may change what flows
  through the layer, which ``W`` would not see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops

from .autodiff import as_tuple, is_float

#: The layer types whose weight gradients :func:`make_linear_weight_grads` computes.
LINEAR_TYPES: tuple[type, ...] = (nn.Dense, mint.nn.Linear)

_STORE, _PROBE, _COUNT = "_ge_zb_store", "_ge_zb_probe", "_ge_zb_count"
_CALLS, _STANDIN = "_ge_zb_calls", "_ge_zb_standin"

#: The cell attributes that hold registered hooks (MindSpore 2.10 keeps them lazily: ``None``
#: until one is registered).
_HOOK_ATTRIBUTES = (
    "_lazy_forward_pre_hook",
    "_lazy_forward_hook",
    "_lazy_backward_pre_hook",
    "_lazy_backward_hook",
    "_lazy_forward_pre_hook_with_kwargs",
    "_lazy_forward_hook_with_kwargs",
    "_cell_backward_pre_hook",
    "_cell_backward_hook",
)

#: Cells run as in evaluation during the trace: they draw random numbers (the older stateful
#: dropout keeps its generator inside the kernel, where it cannot be put back) and never change
#: how many times a layer runs.
_DROPOUT_TYPES: tuple[type, ...] = tuple(
    t for t in (getattr(nn, "Dropout", None), getattr(mint.nn, "Dropout", None)) if t is not None
)


class _ProbedDense(nn.Dense):
    """``nn.Dense.construct`` with the input saved, the call counted and the probe added before
    the activation."""

    def construct(self, x):
        x_shape = self.shape_op(x)
        if len(x_shape) != 2:
            x = self.reshape(x, (-1, x_shape[-1]))
        x = ops.depend(x, ops.assign(self._ge_zb_store, x))
        x = ops.depend(x, ops.assign_add(self._ge_zb_count, ops.ones_like(self._ge_zb_count)))
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
    """``mint.nn.Linear.construct`` with the input saved, the call counted and the probe added."""

    def construct(self, x):
        x = ops.depend(x, ops.assign(self._ge_zb_store, x))
        x = ops.depend(x, ops.assign_add(self._ge_zb_count, ops.ones_like(self._ge_zb_count)))
        return self.dense(x, self.weight, self.bias) + self._ge_zb_probe


class _CountingDense(nn.Dense):
    """Eager only: ``nn.Dense`` on stand-in copies of its weight and bias, recording the (2-D
    input, 2-D output before the activation) of every call."""

    def construct(self, x):
        weight, bias = self._ge_zb_standin
        x_shape = x.shape
        flat = x if x.ndim == 2 else x.reshape((-1, x_shape[-1]))
        y = self.matmul(flat, weight)
        if self.has_bias:
            y = self.bias_add(y, bias)
        self._ge_zb_calls.append((flat, y))
        if self.activation_flag:
            y = self.activation(y)
        return y if x.ndim == 2 else y.reshape((*x_shape[:-1], y.shape[-1]))


class _CountingLinear(mint.nn.Linear):
    """Eager only: ``mint.nn.Linear`` on stand-in copies, recording the (input, output) of
    every call."""

    def construct(self, x):
        weight, bias = self._ge_zb_standin
        y = self.dense(x, weight, bias)
        self._ge_zb_calls.append((x, y))
        return y


def _subclass(layer: nn.Cell, probing: bool) -> type:
    if isinstance(layer, nn.Dense):
        return _ProbedDense if probing else _CountingDense
    return _ProbedLinear if probing else _CountingLinear


def _params(layer: nn.Cell) -> list[Parameter]:
    return [layer.weight] + ([layer.bias] if layer.bias is not None else [])


def _hooked(layer: nn.Cell) -> bool:
    """Whether a hook is registered on ``layer`` or on its weight or bias."""
    if any(getattr(layer, name, None) for name in _HOOK_ATTRIBUTES):
        return True
    return any(getattr(p, "hooks", lambda: None)() for p in _params(layer))


def layer_name(layer: nn.Cell) -> str:
    """A layer's name in errors and reports: its weight's name without ``.weight``."""
    name = layer.weight.name
    return name[: -len(".weight")] if name.endswith(".weight") else name


def linear_candidates(
    cell: nn.Cell, trainable: Sequence[Parameter]
) -> tuple[tuple[nn.Cell, ...], dict[str, str]]:
    """The linear layers of ``cell`` whose weight gradients may move to ``W`` — exact types of
    :data:`LINEAR_TYPES` (a subclass may compute something else), weight and bias in
    ``trainable``, neither registered by any other cell of ``cell``, no hook — and, by layer
    name, why each other linear layer stays whole."""
    trainable_ids = {id(p) for p in trainable}
    holders: dict[int, int] = {}
    cells = [c for _, c in cell.cells_and_names()]
    for c in cells:
        for p in c._params.values():  # a cell's own parameters, not its children's
            holders[id(p)] = holders.get(id(p), 0) + 1
    found, whole = [], {}
    for c in cells:
        if type(c) not in LINEAR_TYPES:
            continue
        params = _params(c)
        if not all(id(p) in trainable_ids for p in params):
            whole[layer_name(c)] = "a weight or bias is frozen"
        elif not all(holders.get(id(p)) == 1 for p in params):
            whole[layer_name(c)] = "its weight or bias is registered by another cell (tied)"
        elif _hooked(c):
            whole[layer_name(c)] = "a hook is registered on it or on its weight or bias"
        else:
            found.append(c)
    return tuple(found), whole


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


@contextmanager
def _state_kept(cell: nn.Cell) -> Iterator[None]:
    """Within: dropout cells run as in evaluation; after: the default random generator and
    every non-trainable parameter (running statistics) are what they were."""
    dropouts = [(c, c.training) for _, c in cell.cells_and_names() if isinstance(c, _DROPOUT_TYPES)]
    frozen = {id(p): p for p in cell.get_parameters() if not p.requires_grad}
    saved = [(p, p.value().copy()) for p in frozen.values()]
    rng = ms.get_rng_state()
    try:
        for c, _ in dropouts:
            c.training = False
        yield
    finally:
        ms.set_rng_state(rng)
        for p, value in saved:
            ops.assign(p, value)
        for c, flag in dropouts:
            c.training = flag


@dataclass(frozen=True)
class Trace:
    """What one eager forward and backward of a chunk showed about its candidate layers:
    ``calls[k]``: the ``(input, output)`` pairs (2-D for ``nn.Dense``) of layer ``k``'s calls;
    ``read_outside[k]``: whether its weight or bias got a gradient from outside the layer."""

    calls: tuple[tuple[tuple[Tensor, Tensor], ...], ...]
    read_outside: tuple[bool, ...]


def _weighted_sum(outputs: tuple, seed: int = 0) -> Tensor:
    """``Σ sum(output * r)`` over the float outputs with fixed random ``r`` (numpy's, so
    MindSpore's generator does not move): a gradient that no structure of the chunk cancels."""
    rng = np.random.default_rng(seed)
    total = ops.zeros((), ms.float32)
    for out in outputs:
        if isinstance(out, Tensor) and is_float(out):
            weights = Tensor(rng.standard_normal(tuple(out.shape)).astype(np.float32))
            total = total + (out.astype(ms.float32) * weights).sum()
    return total


def trace_linear_calls(cell: nn.Cell, layers: Sequence[nn.Cell], inputs: Sequence[Tensor]) -> Trace:
    """Run ``cell`` once eagerly, in the mode the run uses, with ``layers`` counting their calls
    on stand-ins of their weights, and differentiate it with respect to their real weights and
    biases (module docstring: nothing the run sees changes)."""
    params = [p for layer in layers for p in _params(layer)]
    for layer in layers:
        object.__setattr__(layer, _CALLS, [])
        standin = tuple(None if p is None else p.value().copy() for p in (layer.weight, layer.bias))
        object.__setattr__(layer, _STANDIN, standin)

    def run(*args: Tensor) -> Tensor:
        return _weighted_sum(as_tuple(cell(*args)))

    try:
        with _state_kept(cell), _swapped(layers, probing=False):
            grads = ms.grad(run, grad_position=None, weights=ParameterTuple(params))(*inputs)
        calls = tuple(tuple(getattr(layer, _CALLS)) for layer in layers)
    finally:
        for layer in layers:
            object.__delattr__(layer, _CALLS)
            object.__delattr__(layer, _STANDIN)
    read, at = [], 0
    for layer in layers:
        count = len(_params(layer))
        read.append(any(bool(np.any(g.asnumpy())) for g in grads[at : at + count]))
        at += count
    return Trace(calls, tuple(read))


@dataclass(frozen=True)
class LinearSplit:
    """The probed layers of one chunk and input signature, with their probes and stores.

    ``layers``: the split linear layers; ``probes[k]``: zero, shaped like layer ``k``'s 2-D
    output (``mint.nn.Linear``: its output) in the dtype it computes in; ``stores[k]``: shaped
    like its 2-D input; ``counts[k]``: its calls in the last probed forward; ``has_bias[k]``:
    whether ``W`` returns a bias gradient for it; ``whole``: by layer name, why each other
    linear layer of the chunk was left whole.
    """

    layers: tuple[nn.Cell, ...]
    probes: tuple[Parameter, ...]
    stores: tuple[Parameter, ...]
    counts: tuple[Parameter, ...]
    has_bias: tuple[bool, ...]
    whole: dict[str, str]

    def params(self) -> list[Parameter]:
        """The layers' weights and biases in the order :func:`make_linear_weight_grads` returns
        their gradients."""
        return [p for layer in self.layers for p in _params(layer)]

    def compute_dtypes(self) -> tuple[ms.dtype, ...]:
        """The dtype each layer computes in (its output's): its weight's, or float16/bfloat16
        under mixed precision."""
        return tuple(probe.dtype for probe in self.probes)

    def param_dtypes(self) -> tuple[ms.dtype, ...]:
        return tuple(p.dtype for p in self.params())

    def nbytes(self) -> int:
        """Bytes of the probes, stores and counts (held while this split is cached)."""
        return sum(int(t.nbytes) for t in (*self.probes, *self.stores, *self.counts))


def _why_whole(seen: Sequence, read_outside: bool) -> str | None:
    if read_outside:
        return "its weight or bias is also read outside the layer"
    if len(seen) != 1:
        return f"it runs {len(seen)} times per forward (a split needs exactly one)"
    return None


def make_linear_split(
    cell: nn.Cell, trainable: Sequence[Parameter], inputs: Sequence[Tensor], name: str
) -> LinearSplit | None:
    """The :class:`LinearSplit` of ``cell`` for inputs shaped like ``inputs`` (``name``
    prefixes the probes' and stores' parameter names, unique per chunk and signature), or
    ``None`` when no layer can be split exactly."""
    candidates, whole = linear_candidates(cell, trainable)
    if not candidates:
        return None
    trace = trace_linear_calls(cell, candidates, inputs)
    layers, probes, stores, counts = [], [], [], []
    for index, (layer, seen, outside) in enumerate(
        zip(candidates, trace.calls, trace.read_outside, strict=True)
    ):
        why = _why_whole(seen, outside)
        if why is not None:
            whole[layer_name(layer)] = why
            continue
        x, y = seen[0]
        layers.append(layer)
        probes.append(Parameter(ops.zeros(y.shape, y.dtype), name=f"{name}.{index}.probe"))
        stores.append(
            Parameter(ops.zeros(x.shape, x.dtype), name=f"{name}.{index}.store", requires_grad=False)
        )
        counts.append(Parameter(ops.zeros((), ms.float32), name=f"{name}.{index}.count", requires_grad=False))
    if not layers:
        return None
    return LinearSplit(
        tuple(layers),
        tuple(probes),
        tuple(stores),
        tuple(counts),
        tuple(layer.bias is not None for layer in layers),
        whole,
    )


def check_call_counts(split: LinearSplit, counts: Tensor) -> None:
    """Refuse a probed forward in which a split layer ran more than once (its probe then adds
    up several output gradients and its store keeps the last input only: ``W`` would be wrong).
    ``counts``: the forward's copy of the counters (read here, lazily, at ``W``)."""
    for layer, count in zip(split.layers, counts.asnumpy().tolist(), strict=True):
        if count > 1:
            raise ValueError(
                f"body='zb': layer {layer_name(layer)!r} ran {int(count)} times in a forward but once "
                "when its chunk was traced for this input shape, so its weight gradient cannot be split "
                "off; make the number of calls independent of anything but the input shape, or use "
                "the default body"
            )


@contextmanager
def probed(split: LinearSplit) -> Iterator[None]:
    """Within: ``split``'s layers probe (save their input, count their calls, add their
    probe); outside they are the user's layers again, attributes and class."""
    for layer, probe, store, count in zip(
        split.layers, split.probes, split.stores, split.counts, strict=True
    ):
        object.__setattr__(layer, _PROBE, probe)
        object.__setattr__(layer, _STORE, store)
        object.__setattr__(layer, _COUNT, count)
    try:
        with _swapped(split.layers, probing=True):
            yield
    finally:
        for layer in split.layers:
            object.__delattr__(layer, _PROBE)
            object.__delattr__(layer, _STORE)
            object.__delattr__(layer, _COUNT)


def _saved(stores: tuple[Parameter, ...], counts: tuple[Parameter, ...]) -> tuple[Tensor, ...]:
    """Copies of the stores, then the counters stacked: no gradient flows into them."""
    saved = ()
    for store in stores:
        saved = (*saved, ops.stop_gradient(ops.deepcopy(store)))
    copies = ()
    for count in counts:
        copies = (*copies, ops.deepcopy(count))
    return (*saved, ops.stop_gradient(ops.stack(copies)))


def _reset(counts: tuple[Parameter, ...]) -> tuple[Tensor, ...]:
    """Zero the counters; the results order the forward after the resets."""
    done = ()
    for count in counts:
        done = (*done, ops.assign(count, ops.zeros_like(count)))
    return done


def make_probed_forward(cell: nn.Cell, split: LinearSplit) -> Callable[..., tuple[Tensor, ...]]:
    """``forward(*inputs) -> (*outputs, *saved, counts)``: the chunk's outputs, then a copy of
    each probed layer's input and the layers' call counts (no gradient flows into the copies).
    Run it within :func:`probed`."""

    stores, counts = split.stores, split.counts

    def probed_stage_forward(*inputs: Tensor) -> tuple[Tensor, ...]:
        inputs = ops.depend(inputs, _reset(counts))
        outputs = as_tuple(cell(*inputs))
        return outputs + _saved(stores, counts)

    return probed_stage_forward


def make_probed_loss(loss: Callable[..., object], split: LinearSplit) -> Callable[..., tuple[Tensor, ...]]:
    """``loss(*args) -> (*loss, *saved, counts)``: the last stage's loss kernel (a scalar, or a
    per-token ``(sum, count)``) as a tuple, then a copy of each probed layer's input and the
    call counts; the tape differentiates element 0. Run it within :func:`probed`."""

    stores, counts = split.stores, split.counts

    def probed_stage_loss(*args: Tensor) -> tuple[Tensor, ...]:
        args = ops.depend(args, _reset(counts))
        value = loss(*args)
        head = value if isinstance(value, tuple) else (value,)
        return head + _saved(stores, counts)

    return probed_stage_loss


def make_linear_weight_grads(
    has_bias: Sequence[bool],
    compute_dtypes: Sequence[ms.dtype] | None = None,
    param_dtypes: Sequence[ms.dtype] | None = None,
) -> Callable[..., tuple[Tensor, ...]]:
    """``W(*inputs, *output_grads) -> (dW_0, [db_0,] dW_1, ...)``: each layer's weight gradient
    ``dzᵀ · x`` (the product ``nn.Dense``'s own bprop takes: ``MatMul(transpose_a=True)``) and
    its bias gradient ``Σ_rows dz``, in :meth:`LinearSplit.params` order. ``compute_dtypes[k]``:
    the dtype layer ``k`` computed in (``x`` and ``dz`` are cast to it, as the layer cast its
    input); ``param_dtypes``: its weight's and bias's dtypes, which the gradients are cast to
    (the cast's own bprop on the plain body). ``None``: every dtype as given."""
    count = len(has_bias)
    biases = tuple(has_bias)
    computes = tuple(compute_dtypes) if compute_dtypes is not None else (None,) * count
    targets = iter(param_dtypes) if param_dtypes is not None else None
    outs = []
    for k in range(count):
        outs.append(tuple(next(targets) if targets else None for _ in range(1 + biases[k])))
    matmul = ops.MatMul(transpose_a=True)
    row_sum = ops.ReduceSum(keep_dims=False)

    def cast(t: Tensor, dtype: ms.dtype | None) -> Tensor:
        return t if dtype is None or t.dtype == dtype else ops.cast(t, dtype)

    def linear_weight_grads(*tensors: Tensor) -> tuple[Tensor, ...]:
        grads = ()
        for k in range(count):
            x, dz = cast(tensors[k], computes[k]), cast(tensors[count + k], computes[k])
            if x.ndim != 2:
                x = x.reshape((-1, x.shape[-1]))
                dz = dz.reshape((-1, dz.shape[-1]))
            grads = (*grads, cast(matmul(dz, x), outs[k][0]))
            if biases[k]:
                grads = (*grads, cast(row_sum(dz, 0), outs[k][1]))
        return grads

    return linear_weight_grads
