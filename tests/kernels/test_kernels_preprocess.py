"""Preprocess hooks: detached forward, recompute-backward, keyword arguments, frozen towers.

Expected gradients come from ``mindspore.value_and_grad`` on the bare preprocess cell;
tolerance ``|actual - expected| <= 1e-5 + 1e-4 * |expected|``.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ParameterTuple, Tensor, nn, ops

from graph_exec.executors import create_executor
from tests.models.common import assert_close, named
from tests.models.kernel import FEATURES, MODES, WIDTH, Projector, snapshot


class Scaled(nn.Cell):
    """A preprocess with a tensor keyword (``scale``) and a constant keyword (``shift``)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(FEATURES, WIDTH)

    def construct(self, x: Tensor, scale: Tensor | None = None, shift: float = 0.0) -> Tensor:
        out = ops.tanh(self.dense(x)) + shift
        if scale is not None:
            out = out * scale
        return out


def random(*shape: int, seed: int) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def weight_grads(cell: nn.Cell, objective) -> dict[str, np.ndarray]:
    weights = ParameterTuple(cell.trainable_params())
    _, grads = ms.value_and_grad(objective, None, weights)()
    return {p.name: g.asnumpy() for p, g in zip(weights, grads, strict=True)}


@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_the_cell_and_backward_takes_a_missing_cotangent(mode: str) -> None:
    ms.set_seed(4)
    cell = named(Projector(), f"proj_{mode}.")
    x, cotangent = random(3, FEATURES, seed=1), random(3, WIDTH, seed=2)
    executor = create_executor(mode, {}, preprocess=cell)
    outputs = executor.preprocess_forward((x,), {})
    for got, want in zip(outputs, cell(x), strict=True):
        assert_close(got, want, "preprocess output")

    executor.preprocess_backward((x,), {}, (cotangent, None))

    def objective() -> Tensor:
        return (cell(x)[0] * cotangent).sum()

    want = weight_grads(cell, objective)
    got = snapshot(executor.grads())
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        assert_close(got[name], grad, f"gradient of {name}")
    # Only the first output had a cotangent: the second branch gets exactly nothing.
    assert not got[cell.b.weight.name].any()


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_tensor_and_constant(mode: str) -> None:
    ms.set_seed(5)
    cell = named(Scaled(), f"scaled_{mode}.")
    x, scale, cotangent = random(2, FEATURES, seed=3), random(2, WIDTH, seed=4), random(2, WIDTH, seed=5)
    kwargs = {"scale": scale, "shift": 0.5}
    executor = create_executor(mode, {}, preprocess=cell)
    (out,) = executor.preprocess_forward((x,), kwargs)
    assert_close(out, cell(x, **kwargs), "output with keyword arguments")
    (plain,) = executor.preprocess_forward((x,), {})
    assert_close(plain, cell(x), "output without keyword arguments")

    executor.preprocess_backward((x,), kwargs, (cotangent,))

    def objective() -> Tensor:
        return (cell(x, **kwargs) * cotangent).sum()

    want = weight_grads(cell, objective)
    got = snapshot(executor.grads())
    for name, grad in want.items():
        assert_close(got[name], grad, f"gradient of {name}")


def test_a_new_constant_keyword_value_compiles_a_new_graph() -> None:
    executor = create_executor("graph", {}, preprocess=named(Scaled(), "const."))
    x = random(2, FEATURES, seed=6)
    executor.preprocess_forward((x,), {"shift": 0.5})
    before = executor.compile_stats.compilations
    executor.preprocess_forward((x,), {"shift": 0.5})
    assert executor.compile_stats.compilations == before
    (shifted,) = executor.preprocess_forward((x,), {"shift": 2})
    assert executor.compile_stats.compilations == before + 1
    (base,) = executor.preprocess_forward((x,), {"shift": 0.5})
    assert_close(shifted.asnumpy() - base.asnumpy(), np.full((2, WIDTH), 1.5, np.float32), "shift difference")


@pytest.mark.parametrize("mode", MODES)
def test_frozen_preprocess_gets_no_gradients_and_compiles_no_backward(mode: str) -> None:
    cell = named(Projector(), f"frozen_pre_{mode}.")
    for param in cell.trainable_params():
        param.requires_grad = False
    executor = create_executor(mode, {}, preprocess=cell)
    assert executor.grads() == {}
    assert executor.broadcast_tensors() == []
    x = random(2, FEATURES, seed=7)
    executor.preprocess_forward((x,), {})
    compiled = executor.compile_stats.compilations
    executor.preprocess_backward((x,), {}, (random(2, WIDTH, seed=8), random(2, WIDTH, seed=9)))
    assert executor.compile_stats.compilations == compiled
    assert executor.grads() == {}


@pytest.mark.parametrize("mode", MODES)
def test_preprocess_cotangent_count_and_shape_are_checked(mode: str) -> None:
    executor = create_executor(mode, {}, preprocess=named(Projector(), f"check_{mode}."))
    x = random(2, FEATURES, seed=10)
    with pytest.raises(ValueError, match="preprocess: expected 2 cotangent"):
        executor.preprocess_backward((x,), {}, (random(2, WIDTH, seed=11),))
    with pytest.raises(ValueError, match=r"preprocess: cotangent 1 is \[3, 6\]"):
        executor.preprocess_backward((x,), {}, (None, random(3, WIDTH, seed=12)))


def test_preprocess_hooks_need_a_preprocess() -> None:
    executor = create_executor("pynative", {0: named(Projector(), "nopre.")})
    assert executor.broadcast_tensors() == []
    with pytest.raises(RuntimeError, match="without a preprocess"):
        executor.preprocess_forward((random(1, FEATURES, seed=0),), {})
