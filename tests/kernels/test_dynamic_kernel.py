"""``shapes="dynamic"``'s compiled kernel (graph_exec/executors/dynamic_kernel.py): a static graph
for the first shape, one dynamic graph for every other size, a static graph for a shape seen in
``HOT_AFTER`` steps, at most ``MAX_HOT_SHAPES`` of them, the shapes counted on the way bounded;
counted by MindSpore's own compilation count, results exact."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from graph_exec.executors import dynamic_kernel
from graph_exec.executors.dynamic_kernel import (
    HOT_AFTER,
    MAX_COUNTED_SHAPES,
    GeneralisingKernel,
    fits,
    generalised,
)
from graph_exec.executors.graph import mindspore_compilations
from graph_exec.executors.tape import Tape
from tests.models.common import ATOL, RTOL


def test_patterns_generalise_only_the_dims_that_differ():
    pattern = generalised(((3, 4), (2,)), [(5, 4), (2,)])
    assert pattern == ((None, 4), (2,))
    assert fits(pattern, [(9, 4), (2,)]) and not fits(pattern, [(9, 5), (2,)])
    assert generalised(pattern, [(9, 4, 1), (2,)]) == (None, (2,))  # another rank: dynamic rank


def test_two_compilations_for_any_length_and_a_static_graph_for_a_hot_one():
    weight = Parameter(Tensor(np.arange(12, dtype=np.float32).reshape(4, 3)), name="dynamic_kernel_w")

    def project(x, scale):
        return ops.matmul(x, weight) * scale

    step = [0]
    kernel = GeneralisingKernel(project, lambda: step[0])
    scale = Tensor(np.float32(0.5))

    def call(rows: int, times: int = 1) -> int:
        """Run one step calling the kernel ``times`` with ``rows`` rows: MindSpore's compilations."""
        step[0] += 1
        before = mindspore_compilations()
        for _ in range(times):
            x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
            got = kernel(Tensor(x), scale).asnumpy()
            np.testing.assert_allclose(got, (x @ weight.asnumpy()) * 0.5, rtol=1e-6, atol=1e-6)
        return mindspore_compilations() - before

    assert call(3) == 1  # the first shape: a static graph
    assert call(5) == 1  # another size: one dynamic graph, rows dynamic
    assert [call(rows, times=4) for rows in (7, 9, 11, 5)] == [0, 0, 0, 0]  # micro-batches: one step each
    assert HOT_AFTER == 3
    assert call(5) == 1  # the third step with 5 rows: a static graph of its own
    assert call(5) == 0 and call(13) == 0


def make_kernel(name: str, jit_options=None):
    """A small kernel, its step counter and a caller that checks each result against numpy."""
    weight = Parameter(Tensor(np.arange(8, dtype=np.float32).reshape(4, 2)), name=name)

    def project(x):
        return ops.matmul(x, weight)

    step = [0]
    kernel = GeneralisingKernel(project, lambda: step[0], jit_options)

    def call(rows: int) -> int:
        """One step calling the kernel with ``rows`` rows: MindSpore's compilations."""
        step[0] += 1
        before = mindspore_compilations()
        x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
        np.testing.assert_allclose(kernel(Tensor(x)).asnumpy(), x @ weight.asnumpy(), rtol=1e-6, atol=1e-6)
        return mindspore_compilations() - before

    return kernel, call


def test_at_most_max_hot_shapes_get_a_static_graph_and_counting_then_stops(monkeypatch):
    monkeypatch.setattr(dynamic_kernel, "MAX_HOT_SHAPES", 2)
    kernel, call = make_kernel("dynamic_kernel_hot_w")
    assert call(3) == 1 and call(5) == 1  # the first shape's static graph, the dynamic graph
    compiled = [[call(rows) for _ in range(HOT_AFTER - (rows == 5))] for rows in (5, 6, 7)]
    # 5 (seen once already) and 6 become hot: a static graph each in their HOT_AFTER-th step;
    # 7 would be the third hot shape: it stays on the dynamic graph.
    assert compiled == [[0, 1], [0, 0, 1], [0, 0, 0]]
    assert kernel._seen == {}  # no static graph left to give: nothing is counted any more
    assert [call(rows) for rows in (7, 7, 8, 5, 6)] == [0, 0, 0, 0, 0]
    assert kernel._seen == {}


def test_the_shapes_counted_are_bounded_and_a_recurring_one_still_becomes_hot(monkeypatch):
    monkeypatch.setattr(dynamic_kernel, "MAX_COUNTED_SHAPES", 3)
    kernel, call = make_kernel("dynamic_kernel_bound_w")
    assert call(2) == 1
    compiled = []
    for rows in range(3, 40):  # lengths drawn anew every step, 5 rows every third step
        compiled.append(call(rows))
        assert len(kernel._seen) <= dynamic_kernel.MAX_COUNTED_SHAPES
        if rows % 3 == 0:
            compiled.append(call(5))
    # one dynamic graph at the first other size, then one static graph for 5, in its third step
    assert sum(compiled) == 2 and (5,) not in [shape for (shape,) in kernel._seen]
    assert call(5) == 0 and kernel._static_shapes >= {((2, 4),), ((5, 4),)}
    # forgetting counts of lengths drawn once changes no result (checked in every call above)
    assert MAX_COUNTED_SHAPES == 64 and dynamic_kernel.MAX_HOT_SHAPES == 8


def test_jit_options_reach_the_static_and_the_dynamic_graph(monkeypatch):
    given = []
    real = ms.jit

    def recording(function=None, **kwargs):
        given.append(kwargs)
        return real(function, **kwargs)

    monkeypatch.setattr(ms, "jit", recording)
    _, call = make_kernel("dynamic_kernel_options_w", {"jit_level": "O1"})
    assert call(3) == 1 and call(6) == 1
    assert given == [{"jit_level": "O1"}, {"jit_level": "O1"}]


@pytest.mark.parametrize("grad_inputs", [True, False], ids=["input-grads", "weights-only"])
def test_weight_gradients_of_a_taped_kernel_with_two_inputs_are_exact_at_every_size(grad_inputs):
    """Stage 0 after a two-output preprocess: ``tanh(dense(h) + g)`` under the autograd tape,
    its bprop run for two micro-batches of each size. With the arguments passed as one
    ``mindspore.mutable`` tuple, MindSpore 2.10 returned a zero bias gradient from the second
    call of the dynamic graph on (every weight gradient zero without input gradients)."""
    ms.set_seed(3)
    dense = nn.Dense(8, 8)
    dense.update_parameters_name(f"dynamic_kernel_tape_{grad_inputs}.")
    weights = ParameterTuple(dense.trainable_params())

    def entry(h, g):
        return ops.tanh(dense(h) + g)

    step = [0]
    tape = Tape(entry, weights, grad_inputs, lambda kernel: GeneralisingKernel(kernel, lambda: step[0]))
    reference = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(entry, weights)
    rng = np.random.default_rng(0)
    for rows in (2, 3, 4, 3):  # batches of 4, 6, 8, 6 rows in two micro-batches
        step[0] += 1
        before = mindspore_compilations()
        for _ in range(2):
            h, g, sens = (Tensor(rng.standard_normal((rows, 8)).astype(np.float32)) for _ in range(3))
            tape(h, g)
            input_grads, weight_grads = tape.backward((h, g), sens)
            want_inputs, want_weights = reference(h, g, sens)
            for got, want, name in zip(weight_grads, want_weights, ("weight", "bias"), strict=True):
                np.testing.assert_allclose(
                    got.asnumpy(), want.asnumpy(), atol=ATOL, rtol=RTOL, err_msg=f"{name}, {rows} rows"
                )
            for got, want in zip(input_grads, want_inputs if grad_inputs else (), strict=True):
                np.testing.assert_allclose(
                    got.asnumpy(), want.asnumpy(), atol=ATOL, rtol=RTOL, err_msg=f"input, {rows} rows"
                )
        if rows == 4:  # a third size runs the dynamic graph compiled at the second
            assert mindspore_compilations() == before
