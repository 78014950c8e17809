"""Stage hooks one at a time: missing cotangents, integer inputs, accumulation and zeroing.

Every test runs in both modes, with the taped forward (default) and with ``recompute=True``.

Each expected value comes from ``mindspore.value_and_grad`` on the bare cell, without the
executor; tolerance ``|actual - expected| <= 1e-5 + 1e-4 * |expected|``.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ParameterTuple, Tensor, nn, ops

from graph_exec.executors import create_executor
from tests.models.common import assert_close, named
from tests.models.kernel import MODES, WIDTH, Gate, Mixer, assert_grads_close, snapshot


def random(*shape: int, seed: int) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def vjp_reference(cell: nn.Cell, inputs: tuple, cotangents: tuple, grad_inputs: tuple[int, ...]) -> tuple:
    """Input and weight gradients of ``sum_i <output_i, cotangent_i>`` (``None`` skipped)."""

    def objective(*args: Tensor) -> Tensor:
        outputs = cell(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((o * c).sum() for o, c in zip(outputs, cotangents, strict=True) if c is not None)

    weights = ParameterTuple(cell.trainable_params())
    _, (input_grads, weight_grads) = ms.value_and_grad(objective, grad_inputs, weights)(*inputs)
    input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
    return input_grads, {p.name: g.asnumpy() for p, g in zip(weights, weight_grads, strict=True)}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_missing_cotangent_counts_as_zero(mode: str, recompute: bool) -> None:
    """A tuple-output stage where only the first output received a gradient."""
    ms.set_seed(1)
    cell = named(Mixer(), f"mix_{mode}.")
    inputs = (random(3, WIDTH, seed=1), random(3, WIDTH, seed=2))
    cotangents = (random(3, WIDTH, seed=3), None)
    want_inputs, want_weights = vjp_reference(cell, inputs, cotangents, (0, 1))

    executor = create_executor(mode, {0: cell}, recompute=recompute)
    executor.stage_forward(0, 0, inputs)
    got = executor.stage_backward(0, 0, cotangents)
    assert len(got) == 2
    for index, (g, w) in enumerate(zip(got, want_inputs, strict=True)):
        assert_close(g, w, f"input gradient {index}")
    assert_grads_close(snapshot(executor.grads()), want_weights)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_first_stage_input_grads_can_be_skipped(mode: str, recompute: bool) -> None:
    """Stage 0's inputs are raw data or a frozen preprocess's output: no gradient, same weights."""
    ms.set_seed(1)
    cells = {0: named(Mixer(), f"mix_skip_{mode}."), 1: named(Mixer(), f"mix_skip1_{mode}.")}
    inputs = (random(3, WIDTH, seed=1), random(3, WIDTH, seed=2))
    cotangents = (random(3, WIDTH, seed=3), random(3, WIDTH, seed=4))
    references = {stage: vjp_reference(cell, inputs, cotangents, (0, 1)) for stage, cell in cells.items()}
    want_weights = {**references[0][1], **references[1][1]}

    executor = create_executor(mode, cells, first_stage_input_grads=False, recompute=recompute)
    for stage in (0, 1):
        executor.stage_forward(stage, 0, inputs)
    assert executor.stage_backward(0, 0, cotangents) == (None, None)
    stage1_inputs = executor.stage_backward(1, 0, cotangents)  # other stages unchanged
    for index, (g, w) in enumerate(zip(stage1_inputs, references[1][0], strict=True)):
        assert_close(g, w, f"stage 1 input gradient {index}")
    assert_grads_close(snapshot(executor.grads()), want_weights)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_no_cotangent_at_all_gives_zero_input_grads_and_no_weight_grads(mode: str, recompute: bool) -> None:
    cell = named(Mixer(), f"mix0_{mode}.")
    inputs = (random(2, WIDTH, seed=4), random(2, WIDTH, seed=5))
    executor = create_executor(mode, {0: cell}, recompute=recompute)
    executor.stage_forward(0, 0, inputs)
    got = executor.stage_backward(0, 0, (None, None))
    for grad, tensor in zip(got, inputs, strict=True):
        assert grad.shape == tensor.shape
        assert not grad.asnumpy().any()
    assert not any(g.any() for g in snapshot(executor.grads()).values())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_integer_input_passes_through_without_gradient(mode: str, recompute: bool) -> None:
    ms.set_seed(2)
    cell = named(Gate(), f"gate_{mode}.")
    ids = Tensor(np.array([0, 3, 1], dtype=np.int32))
    hidden = random(3, WIDTH, seed=6)
    cotangent = random(3, WIDTH, seed=7)
    want_inputs, want_weights = vjp_reference(cell, (hidden, ids), (cotangent,), (0,))

    executor = create_executor(mode, {0: cell}, recompute=recompute)
    (out,) = executor.stage_forward(0, 0, (hidden, ids))
    assert_close(out, cell(hidden, ids), "forward output")
    d_hidden, d_ids = executor.stage_backward(0, 0, (cotangent,))
    assert d_ids is None
    assert_close(d_hidden, want_inputs[0], "gradient of the float input")
    np.testing.assert_array_equal(ids.asnumpy(), [0, 3, 1])
    assert_grads_close(snapshot(executor.grads()), want_weights)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_accumulate_over_calls_until_zero_grad(mode: str, recompute: bool) -> None:
    ms.set_seed(3)
    cell = named(Gate(), f"acc_{mode}.")
    ids = Tensor(np.array([1, 2], dtype=np.int32))
    hidden, cotangent = random(2, WIDTH, seed=8), random(2, WIDTH, seed=9)
    executor = create_executor(mode, {0: cell}, recompute=recompute)
    for micro in range(2):
        executor.stage_forward(0, micro, (hidden, ids))
        executor.stage_backward(0, micro, (cotangent,))
    _, once = vjp_reference(cell, (hidden, ids), (cotangent,), (0,))
    assert all(np.abs(grad).max() > 0 for grad in once.values())
    assert_grads_close(snapshot(executor.grads()), {name: 2 * grad for name, grad in once.items()}, "twice: ")
    executor.zero_grad()
    assert not any(g.any() for g in snapshot(executor.grads()).values())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_frozen_stage_parameters_get_no_buffers(mode: str, recompute: bool) -> None:
    cell = named(Mixer(), f"frozen_{mode}.")
    for param in cell.a.trainable_params():
        param.requires_grad = False
    executor = create_executor(mode, {0: cell}, recompute=recompute)
    assert sorted(executor.grads()) == sorted(p.name for p in cell.b.trainable_params())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_drop_kept_forgets_every_forward(mode: str, recompute: bool) -> None:
    executor = create_executor(mode, {0: named(Mixer(), f"drop_{mode}.")}, recompute=recompute)
    inputs = (random(2, WIDTH, seed=10), random(2, WIDTH, seed=11))
    executor.stage_forward(0, 0, inputs)
    executor.stage_forward(0, 1, inputs)
    assert sorted(executor.kept()) == [(0, 0), (0, 1)]
    executor.drop_kept()
    assert list(executor.kept()) == []
    with pytest.raises(RuntimeError, match="stage 0, micro 1"):
        executor.stage_backward(0, 1, (None, None))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_parameter_updates_are_seen_by_cached_kernels(mode: str, recompute: bool, cpu_path) -> None:
    """An optimizer step or a broadcast writes parameters between calls; a cached (compiled)
    kernel must read the new values. In-place writes need nothing; ``set_data`` swaps the
    storage, which a compiled graph would not see, so the graph executor recompiles once (noticed
    by address on the CPU fast path, by counting ``set_data`` calls on the device path)."""
    cell = named(Mixer(), f"upd_{mode}.")
    inputs = (random(2, WIDTH, seed=12), random(2, WIDTH, seed=13))
    executor = create_executor(mode, {0: cell}, recompute=recompute)
    executor.stage_forward(0, 0, inputs)
    compiled = executor.compile_stats.compilations

    ops.assign(cell.b.weight, cell.b.weight * 3)
    got = executor.stage_forward(0, 1, inputs)
    assert executor.compile_stats.compilations == compiled
    for index, (g, w) in enumerate(zip(got, cell(*inputs), strict=True)):
        assert_close(g, w, f"output {index} after an in-place update")

    cell.a.bias.set_data(Tensor(np.full(WIDTH, 0.25, np.float32)))
    got = executor.stage_forward(0, 2, inputs)
    assert executor.compile_stats.compilations == compiled + (mode == "graph")
    for index, (g, w) in enumerate(zip(got, cell(*inputs), strict=True)):
        assert_close(g, w, f"output {index} after set_data")
