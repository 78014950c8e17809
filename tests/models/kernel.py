"""Tiny models, data and a non-pipelined reference shared by the kernel and executor tests.

The models are small on purpose (every graph-mode test compiles a few graphs), but they cover
what the hooks must handle: a preprocess with tuple outputs, a stage with tuple inputs and
tuple outputs, an integer input, an integer label, and a last stage with a loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from tests.models.common import assert_close

MODES = ("graph", "pynative")
FEATURES, WIDTH, CLASSES = 5, 6, 3


class Projector(nn.Cell):
    """Preprocess: features ``[B, F]`` → two hidden tensors ``[B, W]``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(FEATURES, WIDTH)
        self.b = nn.Dense(FEATURES, WIDTH)

    def construct(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return ops.tanh(self.a(x)), self.b(x)


class Mixer(nn.Cell):
    """Stage with two inputs and two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(WIDTH, WIDTH)
        self.b = nn.Dense(WIDTH, WIDTH)

    def construct(self, h: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        return ops.tanh(self.a(h)) + g, self.b(g) * h


class Combiner(nn.Cell):
    """Stage with two inputs and one output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Dense(WIDTH, WIDTH)

    def construct(self, u: Tensor, v: Tensor) -> Tensor:
        return ops.tanh(self.a(u * v))


class Classifier(nn.Cell):
    """Last stage: hidden → class logits."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Dense(WIDTH, CLASSES)

    def construct(self, w: Tensor) -> Tensor:
        return self.out(w)


class Gate(nn.Cell):
    """Stage with a float and an integer input: the integer one selects a learned row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Embedding(4, WIDTH)
        self.a = nn.Dense(WIDTH, WIDTH)

    def construct(self, h: Tensor, ids: Tensor) -> Tensor:
        return self.a(h) * self.rows(ids)


def micro_batches(count: int, batch: int = 4, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``count`` (features, int32 labels) micro-batches."""
    rng = np.random.default_rng(seed)
    return [
        (
            Tensor(rng.standard_normal((batch, FEATURES), dtype=np.float32)),
            Tensor(rng.integers(0, CLASSES, (batch,), dtype=np.int32)),
        )
        for _ in range(count)
    ]


def reference(
    loss_of: Callable[..., Tensor], params: Sequence[Parameter], batches: Sequence[tuple[Tensor, ...]]
) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Per-micro-batch losses and the gradients of their sum, by parameter name, computed by
    ``mindspore.value_and_grad`` over the whole model without any pipelining."""
    step = ms.value_and_grad(loss_of, grad_position=None, weights=ParameterTuple(params))
    losses, total = [], {p.name: np.zeros(p.shape, np.float32) for p in params}
    for batch in batches:
        loss, grads = step(*batch)
        losses.append(loss.asnumpy())
        for param, grad in zip(params, grads, strict=True):
            total[param.name] += grad.asnumpy()
    return losses, total


def assert_grads_close(actual: dict[str, Tensor], expected: dict[str, np.ndarray], what: str = "") -> None:
    """Same parameter names, then every gradient within tolerance (an empty dict is no pass)."""
    assert expected, "nothing to compare: the reference has no gradients"
    assert sorted(actual) == sorted(expected), f"{what}gradient names differ"
    for name, value in actual.items():
        assert_close(value, expected[name], f"{what}gradient of {name}")


def snapshot(grads: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """Copies of live gradient buffers (``asnumpy`` is a view on CPU)."""
    return {name: value.asnumpy().copy() for name, value in grads.items()}
