"""Test models and references for what a training loop needs: tied weights, per-token loss,
low precision, the global gradient norm.

Every builder gives bit-identical weights for the same seed in every process (like
:mod:`tests.models.pipeline`, whose cells, :class:`~tests.models.pipeline.Model` and
:func:`~tests.models.pipeline.reference` they reuse), so each rank can build the whole model,
keep its own chunks and compute the non-pipelined reference itself.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, amp, nn, ops

from tests.models.pipeline import CLASSES, FEATURES, TOKENS, WIDTH, Hidden, Model, build

#: Vocabulary of the tied model: its embedding table and its output projection are both
#: ``[TIED_VOCAB, WIDTH]`` (an LM whose input embedding and output head share one matrix).
TIED_VOCAB = 7
#: ``(atol, rtol)`` of each low-precision comparison with the same cast model run in one
#: process, non-pipelined. Measured worst deviations (P = 1, graph mode against the eager
#: reference; pynative was exact): float16 2.7e-4 absolute on gradients up to 0.8 (to_float,
#: O1-O3 alike); bfloat16 (float32 arithmetic between bfloat16 casts) exact.
LOW_PRECISION_TOLERANCE = {ms.float16: (1e-3, 1e-2), ms.bfloat16: (2e-3, 2e-2)}


class TokenMean(nn.Cell):
    """Preprocess of the tied model: token ids ``[B, T]`` -> the mean of their embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(TIED_VOCAB, WIDTH)

    def construct(self, ids):
        return self.table(ids).mean(axis=1)


class TiedHead(nn.Cell):
    """Last stage of the tied model: hidden ``[B, W]`` -> ``[B, TIED_VOCAB]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Dense(WIDTH, TIED_VOCAB, has_bias=False)

    def construct(self, h):
        return self.out(h)


def build_tied(num_stages: int, seed: int = 0) -> tuple[Model, tuple[str, str]]:
    """A token model whose embedding table (the preprocess) and output projection (the last
    stage) start equal, and the pair of their names for ``tied_parameters``."""
    ms.set_seed(seed)
    pre = TokenMean()
    pre.update_parameters_name("pre.")
    cells = [Hidden() for _ in range(num_stages - 1)] + [TiedHead()]
    for k, cell in enumerate(cells):
        cell.update_parameters_name(f"s{k}.")
    head = cells[-1].out.weight
    ops.assign(head, pre.table.embedding_table)
    return Model(pre, cells), (pre.table.embedding_table.name, head.name)


def tied_batch(size: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Token ids ``[size, TOKENS]`` and int32 labels in the tied model's vocabulary."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, TIED_VOCAB, (size, TOKENS), dtype=np.int32)
    return Tensor(ids), Tensor(rng.integers(0, TIED_VOCAB, (size,), dtype=np.int32))


def tie(grads: dict[str, np.ndarray], pair: tuple[str, str]) -> dict[str, np.ndarray]:
    """The gradients of the tied model: both names of ``pair`` get the sum of both uses'."""
    total = grads[pair[0]] + grads[pair[1]]
    return {**grads, pair[0]: total, pair[1]: total}


def global_norm(grads: dict[str, np.ndarray], norm_type: float = 2.0, skip: tuple[str, ...] = ()) -> float:
    """The ``norm_type``-norm over every gradient (in float64), each name once, ``skip`` left out."""
    values = [v.astype(np.float64).ravel() for k, v in grads.items() if k not in skip]
    flat = np.concatenate(values)
    if math.isinf(norm_type):
        return float(np.abs(flat).max())
    return float((np.abs(flat) ** norm_type).sum() ** (1.0 / norm_type))


def token_loss(logits, labels, mask):
    """Per-token loss for ``loss_reduction="token"``: ``(Σ mask·ce, Σ mask)`` over the rows of a
    micro-batch (each row is one "token"; ``mask`` 0 marks padding)."""
    weights = mask.astype(ms.float32)
    return (ops.cross_entropy(logits, labels, reduction="none") * weights).sum(), weights.sum()


def padding_mask(size: int, micro: int, seed: int = 2) -> Tensor:
    """A 0/1 float mask of ``size`` rows whose micro-batches hold different token counts (each
    at least one, micro-batch 0 all but one)."""
    rng = np.random.default_rng(seed)
    rows = size // micro
    mask = np.zeros(size, np.float32)
    for m in range(micro):
        keep = rows - 1 if m == 0 else int(rng.integers(1, rows + 1))
        mask[m * rows : m * rows + keep] = 1.0
    return Tensor(mask)


def token_reference(
    model: Model, x: Tensor, labels: Tensor, mask: Tensor, micro: int
) -> tuple[list[float], dict[str, np.ndarray], float]:
    """Per-micro ``sum / count``, the gradients of ``Σ sums / Σ counts`` over the whole batch,
    and that objective, without pipelining."""
    params = model.params()

    def summed(x, labels, mask):
        h = model.preprocess(x) if model.preprocess is not None else (x,)
        for stage in model.stages:
            h = stage(*h) if isinstance(h, tuple) else stage(h)
        return token_loss(h, labels, mask)[0]

    step = ms.value_and_grad(summed, grad_position=None, weights=ParameterTuple(params))
    size = x.shape[0] // micro
    losses, total = [], {p.name: np.zeros(p.shape, np.float32) for p in params}
    sums = 0.0
    for m in range(micro):
        rows = slice(m * size, (m + 1) * size)
        value, grads = step(x[rows], labels[rows], mask[rows])
        count = float(mask[rows].asnumpy().sum())
        losses.append(float(value.asnumpy()) / max(count, 1.0))
        sums += float(value.asnumpy())
        for param, grad in zip(params, grads, strict=True):
            total[param.name] += grad.asnumpy()
    count = max(float(mask.asnumpy().sum()), 1.0)
    return losses, {k: v / count for k, v in total.items()}, sums / count


class GatedHidden(nn.Cell):
    """A :class:`~tests.models.pipeline.Hidden` stage whose bias gradient overflows on demand:
    its output is ``tanh(a(h)) + 0 · gate²`` (exactly ``tanh(a(h))``), but the bias also gets
    ``gate² · Σ dL/dy``, which is infinite for ``gate = OVERFLOW_GATE`` and zero for the
    default ``gate = 0``. One stage's gradients on one rank overflow, nothing else changes."""

    def __init__(self, hidden: Hidden, prefix: str) -> None:
        super().__init__()
        self.a = hidden.a
        self.gate = Parameter(Tensor(0.0, ms.float32), name="gate", requires_grad=False)
        self.update_parameters_name(prefix)

    def construct(self, h):
        leak = (self.a.bias - ops.stop_gradient(self.a.bias)).sum()
        return ops.tanh(self.a(h)) + leak * self.gate * self.gate

    def overflow(self, on: bool) -> None:
        """Make the next backward's bias gradient infinite (``on``) or exact again."""
        ops.assign(self.gate, Tensor(OVERFLOW_GATE if on else 0.0, ms.float32))


#: The gate of :class:`GatedHidden` whose square overflows float32.
OVERFLOW_GATE = 3e38


def build_gated(num_stages: int, gated: int, seed: int = 0) -> Model:
    """The pipeline test model (trainable preprocess) with stage ``gated`` a :class:`GatedHidden`."""
    model = build(num_stages, "trainable", seed=seed)
    model.stages[gated] = GatedHidden(model.stages[gated], f"s{gated}.")
    return model


class Bf16Dense(nn.Cell):
    """A dense layer with bfloat16 weights whose arithmetic runs in float32 (MindSpore 2.10 has
    no bfloat16 MatMul, Tanh or Softmax kernel on CPU) and whose output is bfloat16 again
    (``last``: float32 logits for the loss)."""

    def __init__(self, inputs: int, outputs: int, last: bool = False) -> None:
        super().__init__()
        dense = nn.Dense(inputs, outputs)
        self.weight = Parameter(dense.weight.astype(ms.bfloat16), name="weight")
        self.bias = Parameter(dense.bias.astype(ms.bfloat16), name="bias")
        self.last = last

    def construct(self, h):
        y = ops.matmul(h.astype(ms.float32), self.weight.astype(ms.float32).T) + self.bias.astype(ms.float32)
        return y if self.last else ops.tanh(y).astype(ms.bfloat16)


def build_low_precision(num_stages: int, dtype: ms.dtype, how: str = "to_float", seed: int = 0) -> Model:
    """The pipeline test model (trainable preprocess) cast for low precision.

    float16: ``how="to_float"`` computes every cell in float16 (``Cell.to_float``) with its
    parameters stored in float16 too (activations and cotangents between stages are float16);
    ``"O1"``/``"O2"``/``"O3"``: ``mindspore.amp.auto_mixed_precision`` of every cell (float32
    parameters; O1 rewrites the cell and renames its parameters, so each cell's prefix is set
    again). bfloat16: bfloat16 parameters and activations around float32 arithmetic
    (:class:`Bf16Dense`; the amp tools cannot compute in bfloat16 on CPU).
    """
    if dtype == ms.bfloat16:
        ms.set_seed(seed)
        pre = Bf16Dense(FEATURES, WIDTH)
        pre.update_parameters_name("pre.")
        cells = [Bf16Dense(WIDTH, WIDTH) for _ in range(num_stages - 1)] + [
            Bf16Dense(WIDTH, CLASSES, last=True)
        ]
        for k, cell in enumerate(cells):
            cell.update_parameters_name(f"s{k}.")
        return Model(pre, cells)
    model = build(num_stages, "trainable", seed=seed)
    named = [("pre.", model.preprocess)] + [(f"s{k}.", cell) for k, cell in enumerate(model.stages)]
    cast = []
    for prefix, cell in named:
        if how == "to_float":
            cell.to_float(ms.float16)
            for param in cell.get_parameters():
                param.set_dtype(ms.float16)
        else:
            cell = amp.auto_mixed_precision(cell, how, dtype=ms.float16)
            if not next(cell.get_parameters()).name.startswith(prefix):
                cell.update_parameters_name(prefix)
        cast.append(cell)
    return Model(cast[0], cast[1:])
