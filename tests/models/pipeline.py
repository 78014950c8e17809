"""A tiny model family for runtime tests, with a non-pipelined reference.

One builder covers every schedule variant the runtime must handle: a preprocess block that
is trainable, frozen or absent; a preprocess with *two* outputs (so transfers carry tensor
groups); an integer-token entry stage for the dataload-only case; any number of stages. The
same seed gives bit-identical weights in every process, so each rank can build the whole
model, keep its own chunks, and compute the reference itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from tests.models.common import loss_fn

FEATURES, WIDTH, CLASSES, VOCAB, TOKENS = 6, 8, 3, 11, 4


class Projector(nn.Cell):
    """Preprocess: features ``[B, F]`` -> two hidden tensors ``[B, W]``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(FEATURES, WIDTH)
        self.b = nn.Dense(FEATURES, WIDTH)

    def construct(self, x):
        return ops.tanh(self.a(x)), self.b(x)


class PairEntry(nn.Cell):
    """Stage 0 body after a preprocess: two inputs, one output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(WIDTH, WIDTH)

    def construct(self, h, g):
        return ops.tanh(self.a(h) + g)


class FeatureEntry(nn.Cell):
    """Stage 0 without a preprocess: raw features in."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(FEATURES, WIDTH)

    def construct(self, x):
        return ops.tanh(self.a(x))


class TokenEntry(nn.Cell):
    """Stage 0 without a preprocess: integer token ids ``[B, T]`` in (they take no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def construct(self, ids):
        return self.table(ids).mean(axis=1)


class Hidden(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(WIDTH, WIDTH)

    def construct(self, h):
        return ops.tanh(self.a(h))


class Head(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Dense(WIDTH, CLASSES)

    def construct(self, h):
        return self.out(h)


@dataclass
class Model:
    """The whole model: optional preprocess, one cell per stage, the loss."""

    preprocess: nn.Cell | None
    stages: list[nn.Cell]

    def params(self) -> list[Parameter]:
        cells = ([self.preprocess] if self.preprocess is not None else []) + self.stages
        return [p for cell in cells for p in cell.trainable_params()]

    def loss(self, x, labels):
        h = self.preprocess(x) if self.preprocess is not None else (x,)
        for stage in self.stages:
            h = stage(*h) if isinstance(h, tuple) else stage(h)
        return loss_fn(h, labels)


def build(num_stages: int, preprocess: str, tokens: bool = False, seed: int = 0) -> Model:
    """``preprocess``: ``"trainable"``, ``"frozen"`` or ``"none"``; ``tokens``: int entry stage."""
    ms.set_seed(seed)
    pre = None
    if preprocess != "none":
        pre = Projector()
        pre.update_parameters_name("pre.")
        if preprocess == "frozen":
            for p in pre.get_parameters():
                p.requires_grad = False
    if num_stages == 1:
        raise ValueError("use at least 2 stages")
    entry = PairEntry() if pre is not None else (TokenEntry() if tokens else FeatureEntry())
    cells = [entry] + [Hidden() for _ in range(num_stages - 2)] + [Head()]
    for k, cell in enumerate(cells):
        cell.update_parameters_name(f"s{k}.")
    return Model(pre, cells)


def batch(size: int, tokens: bool = False, seed: int = 1) -> tuple[Tensor, Tensor]:
    """A global batch: (features or token ids, int32 labels)."""
    rng = np.random.default_rng(seed)
    x = (
        rng.integers(0, VOCAB, (size, TOKENS), dtype=np.int32)
        if tokens
        else rng.standard_normal((size, FEATURES), dtype=np.float32)
    )
    return Tensor(x), Tensor(rng.integers(0, CLASSES, (size,), dtype=np.int32))


def reference(model: Model, x: Tensor, labels: Tensor, micro: int, scale: float = 1.0):
    """Per-micro losses and the gradients of ``scale * sum(losses)``, without pipelining."""
    params = model.params()
    step = ms.value_and_grad(model.loss, grad_position=None, weights=ParameterTuple(params))
    size = x.shape[0] // micro
    losses, total = [], {p.name: np.zeros(p.shape, np.float32) for p in params}
    for m in range(micro):
        loss, grads = step(x[m * size : (m + 1) * size], labels[m * size : (m + 1) * size])
        losses.append(float(loss.asnumpy()))
        for param, grad in zip(params, grads, strict=True):  # numpy has no bfloat16
            total[param.name] += scale * grad.astype(ms.float32).asnumpy()
    return losses, total


def sgd_step(params: list[Parameter], grads: dict[str, np.ndarray], lr: float) -> None:
    """What ``nn.SGD`` without momentum does, for the reference model."""
    for p in params:
        ops.assign(p, Tensor(p.asnumpy() - lr * grads[p.name]))
