"""Gradient accumulators: on CPU the float32/float64 ones are added into on the host, straight
into their memory (by address in C++, or through numpy for a gradient laid out otherwise); the
sums must be bit-identical to MindSpore's own ``assign_add``, be seen by eager ops and compiled
graphs, and come after any queued write. Other dtypes keep ``assign_add``."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor, ops

from graph_exec.kernels import GradBuffers, make_accumulate, make_buffer
from graph_exec.kernels.grad_buffers import make_host_accumulate


def buffers_like(values: list[np.ndarray], prefix: str) -> ParameterTuple:
    return ParameterTuple(
        [make_buffer(Parameter(Tensor(v), name=f"{prefix}{i}")) for i, v in enumerate(values)]
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_adds_equal_assign_add_bit_for_bit(dtype: type) -> None:
    rng = np.random.default_rng(3)
    shapes = [(7, 5), (5,), (3, 4, 2), (0, 3)]
    micro_grads = [
        [rng.standard_normal(s).astype(dtype) * 10.0 ** rng.integers(-3, 3) for s in shapes] for _ in range(5)
    ]
    host, eager = buffers_like(micro_grads[0], "h."), buffers_like(micro_grads[0], "e.")
    host_add = make_host_accumulate(host)
    assert host_add is not None
    for grads in micro_grads:
        host_add(*(Tensor(g) for g in grads))
        make_accumulate(eager)(*(Tensor(g) for g in grads))
    for h, e in zip(host, eager, strict=True):
        assert h.asnumpy().tobytes() == e.asnumpy().tobytes()


def test_gradients_laid_out_otherwise_are_added_by_value() -> None:
    """A transposed view, a slice at an offset and a gradient still being computed by a graph."""
    rng = np.random.default_rng(4)
    source = rng.standard_normal((6, 5)).astype(np.float32)
    (buffer,) = buffers_like([np.zeros((5, 4), np.float32)], "layout.")
    add = make_host_accumulate(ParameterTuple([buffer]))
    transposed = ops.transpose(Tensor(source[:4]), (1, 0))
    rows = rng.standard_normal((7, 4)).astype(np.float32)
    sliced = Tensor(rows)[1:6]
    assert not transposed.is_contiguous()
    assert sliced.is_contiguous() and sliced.storage_offset() == 4

    @ms.jit
    def scaled(x: Tensor) -> Tensor:
        return ops.matmul(x, ops.eye(4, 4, ms.float32)) * 3

    add(transposed)
    add(sliced)
    add(scaled(Tensor(source[1:5].T.copy())))
    expected = source[:4].T + rows[1:6] + source[1:5].T * 3
    np.testing.assert_allclose(buffer.asnumpy(), expected, rtol=1e-6)


def test_host_adds_are_seen_by_ops_and_graphs_and_follow_queued_writes() -> None:
    (buffer,) = buffers_like([np.zeros(4, np.float32)], "seen.")
    add = make_host_accumulate(ParameterTuple([buffer]))

    @ms.jit
    def doubled() -> Tensor:
        return buffer * 2

    ops.assign(buffer, ops.full((4,), 5.0, dtype=ms.float32))  # queued before the add
    add(Tensor(np.arange(4, dtype=np.float32)))
    expected = np.arange(4, dtype=np.float32) + 5
    np.testing.assert_array_equal((buffer + 0).asnumpy(), expected)
    np.testing.assert_array_equal(doubled().asnumpy(), 2 * expected)
    add(Tensor(np.ones(4, np.float32)))  # a graph that already ran sees the next write too
    np.testing.assert_array_equal(doubled().asnumpy(), 2 * (expected + 1))


def test_other_dtypes_keep_assign_add() -> None:
    values = [np.ones(3, np.float16)]
    buffers = ParameterTuple([Parameter(Tensor(np.zeros(3, np.float16)), name="half.0", requires_grad=False)])
    assert make_host_accumulate(buffers) is None
    grads = GradBuffers([Parameter(Tensor(values[0]), name="half.p")], list(buffers))
    grads.add(Tensor(np.full(3, 0.5, np.float16)))
    grads.add(Tensor(np.full(3, 0.25, np.float16)))
    np.testing.assert_array_equal(buffers[0].asnumpy(), np.full(3, 0.75, np.float16))


def test_float32_accumulators_take_the_host_path_only_on_the_cpu_fast_path(cpu_path) -> None:
    params = [Parameter(Tensor(np.ones(2, np.float32)), name=f"path.{cpu_path.cpu_fast_paths}")]
    grads = GradBuffers(params, [make_buffer(params[0])])
    maker = "make_host_accumulate" if cpu_path.cpu_fast_paths else "make_accumulate"
    assert grads.add.__qualname__.startswith(maker)
    grads.add(Tensor(np.full(2, 0.5, np.float32)))
    grads.add(Tensor(np.full(2, 0.25, np.float32)))
    np.testing.assert_array_equal(grads.buffers[0].asnumpy(), np.full(2, 0.75, np.float32))


@pytest.mark.parametrize("dtype", [ms.float16, ms.bfloat16])
def test_low_precision_parameters_accumulate_in_float32(dtype) -> None:
    """Summing many micro-batch gradients in float16 or bfloat16 would lose most of their bits."""
    param = Parameter(Tensor(np.ones((2, 3), np.float32)).astype(dtype), name=f"low.{dtype}")
    buffer = make_buffer(param)
    assert buffer.dtype == ms.float32 and tuple(buffer.shape) == (2, 3)
    assert not buffer.asnumpy().any()
