"""The whole-gradient kernels (kernels/grad_ops.py): the compiled and eager MindSpore forms and
the host forms of the CPU fast path (C++ by address, numpy views) give the same answers (norm
shares within rtol 1e-6, scaling, zeroing and setting aside bit for bit, the overflow verdict of
``mindspore.amp.all_finite`` on the unscaled gradients)."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, ParameterTuple, Tensor, amp, ops

from graph_exec.kernels import (
    HostGradients,
    accumulator_dtype,
    make_add_back,
    make_multiply_grads,
    make_norm_part,
    make_set_aside,
    make_unscale_and_check,
    make_zero_grads,
)

PREPARE = {"graph": ms.jit, "pynative": lambda kernel: kernel}
SHAPES = [(7, 5), (5,), (3, 4, 2), (0, 3)]


def buffers(prefix: str, seed: int = 0, dtype: type = np.float32) -> ParameterTuple:
    rng = np.random.default_rng(seed)
    return ParameterTuple(
        [
            Parameter(
                Tensor(rng.standard_normal(shape).astype(dtype)),
                name=f"{prefix}{i}",
                requires_grad=False,
            )
            for i, shape in enumerate(SHAPES)
        ]
    )


def values(params: ParameterTuple) -> list[np.ndarray]:
    return [p.asnumpy().copy() for p in params]


@pytest.mark.parametrize("mode", list(PREPARE))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_norm_shares_agree_with_numpy_in_float64(mode: str, norm_type: float) -> None:
    params = buffers(f"norm_{mode}_{norm_type}.")
    flat = np.concatenate([v.ravel().astype(np.float64) for v in values(params)])
    want = np.abs(flat).max() if math.isinf(norm_type) else (np.abs(flat) ** norm_type).sum()
    nonempty = ParameterTuple([p for p in params if p.size])  # the compiled share needs one tensor
    compiled = float(PREPARE[mode](make_norm_part(nonempty, norm_type))().asnumpy())
    assert compiled == pytest.approx(want, rel=1e-6)
    assert HostGradients(params).norm_part(range(len(params)), norm_type) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.5, math.inf])
def test_host_shares_of_float64_and_mixed_buffers(dtype: type, norm_type: float) -> None:
    params = ParameterTuple([*buffers(f"mixed_{dtype.__name__}_{norm_type}.", 3, dtype), *buffers("f32.", 4)])
    flat = np.concatenate([v.ravel().astype(np.float64) for v in values(params)])
    want = np.abs(flat).max() if math.isinf(norm_type) else (np.abs(flat) ** norm_type).sum()
    share = HostGradients(params).norm_part(range(len(params)), norm_type)
    assert share == pytest.approx(want, rel=1e-12 if dtype is np.float64 else 1e-6)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("norm_type", [2.0, 3.0, math.inf])
def test_host_norm_of_a_non_finite_gradient_is_not_finite(bad: float, norm_type: float) -> None:
    """What clip_grad_norm relies on without a scaler: it scales nothing for such a norm. A
    NaN stays NaN even in the largest-value norm (numpy's max; a plain C max would skip it)."""
    params = buffers(f"nonfinite_{bad}_{norm_type}.")
    ops.assign(params[1], ops.fill(ms.float32, params[1].shape, float(bad)))
    share = HostGradients(params).norm_part(range(len(params)), norm_type)
    assert math.isnan(share) if np.isnan(bad) else math.isinf(share)


@pytest.mark.parametrize("mode", list(PREPARE))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scaling_zeroing_and_setting_aside_are_the_same_on_the_host(mode: str, dtype: type) -> None:
    name = f"{mode}_{dtype.__name__}"
    device, host = buffers(f"scale_d_{name}.", dtype=dtype), buffers(f"scale_h_{name}.", dtype=dtype)
    on_host = HostGradients(host)
    PREPARE[mode](make_multiply_grads(device))(Tensor(0.375, ms.float32))
    on_host.multiply(0.375)
    for a, b in zip(values(device), values(host), strict=True):
        assert a.tobytes() == b.tobytes()
    scaled = values(host)
    on_host.multiply(1.0)  # writes nothing, changes nothing
    assert all(a.tobytes() == b.tobytes() for a, b in zip(scaled, values(host), strict=True))
    before = values(host)
    kept_device = ParameterTuple([Parameter(ops.zeros_like(p), name=f"kept.{p.name}") for p in device])
    PREPARE[mode](make_set_aside(device, kept_device))()
    on_host.set_aside()
    assert not any(v.any() for v in values(device) + values(host))
    for p in (*device, *host):
        ops.assign_add(p, ops.ones_like(p))  # this step's gradients
    PREPARE[mode](make_add_back(device, kept_device))()
    on_host.add_back()
    for a, b, was in zip(values(device), values(host), before, strict=True):
        assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(b, was + 1)
    PREPARE[mode](make_zero_grads(device))()
    on_host.zero()
    for a, b in zip(values(device), values(host), strict=True):
        assert a.tobytes() == b.tobytes() == np.zeros_like(b).tobytes()  # +0.0, like the kernel


@pytest.mark.parametrize("mode", list(PREPARE))
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("norm_type", [None, 2.0, math.inf])
@pytest.mark.parametrize("where", [2, 1])  # in a counted accumulator, in one left out of the share
def test_unscaling_checks_and_measures_what_the_separate_kernels_do(
    mode: str, bad: float | None, norm_type, where: int
) -> None:
    fused, host, apart = (buffers(f"check_{kind}_{mode}_{bad}_{norm_type}_{where}.") for kind in "fha")
    if bad is not None:
        for params in (fused, host, apart):
            ops.assign(params[where], ops.fill(ms.float32, params[where].shape, float(bad)))
    counted = (0, 2)  # a share of some accumulators only, as on a rank that skips tied seconds
    pair = PREPARE[mode](make_unscale_and_check(fused, counted, norm_type))(Tensor(0.375, ms.float32))
    host_finite, host_share = HostGradients(host).unscale_and_check(0.375, counted, norm_type)
    PREPARE[mode](make_multiply_grads(apart))(Tensor(0.375, ms.float32))
    for a, b, c in zip(values(fused), values(host), values(apart), strict=True):
        assert a.tobytes() == b.tobytes() == c.tobytes()
    finite = bool(amp.all_finite(list(apart)).asnumpy())
    assert finite is (bad is None)
    assert bool(pair.asnumpy()[0] == 1.0) is finite and host_finite is finite
    if norm_type is None:
        assert float(pair.asnumpy()[1]) == 0.0 and host_share == 0.0
    elif bad is None or where not in counted:
        want = float(make_norm_part(ParameterTuple([apart[i] for i in counted]), norm_type)().asnumpy())
        assert float(pair.asnumpy()[1]) == pytest.approx(want, rel=1e-6)
        assert host_share == pytest.approx(want, rel=1e-6)
    elif not (norm_type == math.inf and np.isnan(bad)):  # MindSpore's max skips a NaN: the flag tells
        assert not math.isfinite(float(pair.asnumpy()[1])) and not math.isfinite(host_share)


def test_host_arithmetic_refuses_a_dtype_it_has_no_loop_for() -> None:
    half = ParameterTuple([Parameter(Tensor(np.ones(3, np.float16)), name="half.0", requires_grad=False)])
    with pytest.raises(TypeError, match="Float16"):
        HostGradients(half)


def test_low_precision_parameters_get_float32_accumulators() -> None:
    assert accumulator_dtype(ms.float16) == ms.float32 and accumulator_dtype(ms.bfloat16) == ms.float32
    assert accumulator_dtype(ms.float32) == ms.float32 and accumulator_dtype(ms.float64) == ms.float64
