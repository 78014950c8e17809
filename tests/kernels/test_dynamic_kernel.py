"""``shapes="dynamic"``'s compiled kernel (graph_exec/executors/dynamic_kernel.py): a static graph
for the first shape, one dynamic graph for every other size, a static graph for a shape seen in
``HOT_AFTER`` steps; counted by MindSpore's own compilation count, results exact."""

from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

from graph_exec.executors.dynamic_kernel import HOT_AFTER, GeneralisingKernel, fits, generalised
from graph_exec.executors.graph import mindspore_compilations


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
