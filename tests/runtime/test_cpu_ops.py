"""The CPU stand-ins of ``graph_exec.models.cpu_ops``: each equal to the op it replaces on CPU
(checked against numpy, since the op itself has no CPU kernel to compare with), the original op
off CPU whichever order the device and the import came in, and a clear refusal of what a
stand-in does not implement."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import mint, nn, ops

from graph_exec.models import cpu_ops

PROBE = Path(__file__).with_name("stand_ins_off_cpu.py")
ROOT = Path(__file__).parents[2]


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_installed_with_the_error_each_avoids():
    assert cpu_ops.needed() and cpu_ops.applied()
    for r in cpu_ops.REPLACEMENTS:
        installed = getattr(r.owner, r.name)
        if isinstance(r.stand_in, type):
            assert installed is r.stand_in and issubclass(r.stand_in, cpu_ops.original(r)), r.where
        else:
            assert installed is not cpu_ops.original(r) and installed.__name__ == r.stand_in.__name__
        assert r.error.startswith("RuntimeError: ") and "kernel" in r.error.lower()
    assert len(cpu_ops.describe()) == len(cpu_ops.REPLACEMENTS)
    installed = [getattr(r.owner, r.name) for r in cpu_ops.REPLACEMENTS]
    cpu_ops.apply()  # idempotent
    assert [getattr(r.owner, r.name) for r in cpu_ops.REPLACEMENTS] == installed


@pytest.mark.parametrize(("order", "target"), [("after", "Ascend"), ("before", "GPU"), ("after", "CPU")])
def test_the_original_ops_run_off_cpu_whenever_the_device_was_chosen(order, target, tmp_path):
    """A fresh process acting as a script on ``target`` that chose its device ``order``
    ``import graph_exec.models`` (MindSpore's target faked where the library reads it: this
    MindSpore has CPU kernels only). Off CPU every replaced op, eager or compiled, is the
    original: it raises here the missing-kernel error of its table entry. On CPU each computes."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "GLOG_v": "3"}
    done = subprocess.run(
        [sys.executable, str(PROBE), order, target],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,  # where MindSpore writes its reports of the failed compiles
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["policy"] == target  # read again after the import asked for it
    assert all(report["originals kept"].values()), report["originals kept"]
    results = report["results"]
    for r in cpu_ops.REPLACEMENTS:
        if target == "CPU":
            assert results[r.where] == "computed", r.where
        else:
            assert r.error.startswith(results[r.where].rstrip(".")), (r.where, results[r.where])
    compiled = {results["jit(function)"], results["jit(mint.nn.LayerNorm)"]}
    assert compiled == ({"computed"} if target == "CPU" else {"RuntimeError: - Kernel select failed:"})


def test_unimplemented_arguments_are_refused_naming_the_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a refused compile writes its report to rank_0/
    ids = ms.Tensor(np.array([1, 2], np.int32))
    weight = ms.Tensor(f32(4, 3))
    with pytest.raises(ValueError, match=r"embedding: max_norm=1.0 is not implemented .*use max_norm=None"):
        mint.nn.functional.embedding(ids, weight, max_norm=1.0)
    with pytest.raises(ValueError, match="scale_grad_by_freq=True is not implemented"):
        mint.nn.functional.embedding(ids, weight, scale_grad_by_freq=True)
    with pytest.raises(ValueError, match=r"max_norm=2\.0 is not implemented"):
        mint.nn.Embedding(4, 3, max_norm=2.0)(ids)
    with pytest.raises(ValueError, match=r"(?i)scale_grad_by_freq=true is not implemented"):  # jit: "true"
        ms.jit(mint.nn.Embedding(4, 3, scale_grad_by_freq=True))(ids)
    images = ms.Tensor(f32(1, 3, 4, 4, 4))
    with pytest.raises(ValueError, match=r"padding_mode='reflect' is not implemented .*'zeros'"):
        mint.nn.Conv3d(3, 2, 3, padding=1, padding_mode="reflect")(images)
    with pytest.raises(ValueError, match=r"padding='same' is not implemented"):
        mint.nn.Conv3d(3, 2, 3, padding="same")(images)
    valid = mint.nn.Conv3d(3, 2, 3, padding="valid", bias=False)
    assert valid(images).shape == (1, 2, 2, 2, 2)


def test_functions_equal_numpy():
    x, y = f32(3, 4), f32(4, seed=1)
    np.testing.assert_array_equal(mint.arange(5).asnumpy(), np.arange(5))
    np.testing.assert_array_equal(mint.arange(1, 8, 2, dtype=ms.float32).asnumpy(), np.arange(1, 8, 2))
    np.testing.assert_array_equal(mint.full((2, 3), 7.0).asnumpy(), np.full((2, 3), 7.0))
    np.testing.assert_array_equal(mint.zeros_like(ms.Tensor(x)).asnumpy(), np.zeros_like(x))
    np.testing.assert_array_equal(mint.ones_like(ms.Tensor(x), dtype=ms.int32).asnumpy(), np.ones((3, 4)))
    np.testing.assert_array_equal(mint.full_like(ms.Tensor(x), 2.5).asnumpy(), np.full_like(x, 2.5))
    np.testing.assert_array_equal(mint.stack([ms.Tensor(x)] * 2, dim=1).asnumpy(), np.stack([x] * 2, 1))
    np.testing.assert_allclose(mint.cumsum(ms.Tensor(x), 1).asnumpy(), np.cumsum(x, 1), rtol=1e-6)
    np.testing.assert_allclose(mint.outer(ms.Tensor(y), ms.Tensor(y)).asnumpy(), np.outer(y, y), rtol=1e-6)
    counts = ms.Tensor(np.array([2, 3], np.int32))
    np.testing.assert_array_equal(
        mint.repeat_interleave(ms.Tensor(np.array([4, 5], np.int32)), counts, 0).asnumpy(), [4, 4, 5, 5, 5]
    )
    padded = mint.nn.functional.pad(ms.Tensor(np.array([1, 2], np.int32)), (1, 0), value=0)
    np.testing.assert_array_equal(padded.asnumpy(), [0, 1, 2])
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(
        mint.nn.functional.gelu(ms.Tensor(x)).asnumpy(), x * 0.5 * (1 + erf(x / 2**0.5)), atol=1e-6
    )
    np.testing.assert_array_equal(
        mint.nn.functional.dropout(ms.Tensor(x), p=0.5, training=False).asnumpy(), x
    )
    shifted = x - x.max(-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        mint.nn.functional.log_softmax(ms.Tensor(x), dim=-1).asnumpy(), expected, atol=1e-5
    )
    out, rstd = ops.rms_norm(ms.Tensor(x), ms.Tensor(y))
    want = 1 / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rstd.asnumpy(), want, rtol=1e-5)
    np.testing.assert_allclose(out.asnumpy(), x * want * y, rtol=1e-5, atol=1e-6)


def test_embedding_gathers_rows_and_keeps_the_padding_row_out_of_the_gradient():
    layer = mint.nn.Embedding(6, 3, padding_idx=0)  # the stand-in class, installed
    ids = ms.Tensor(np.array([[0, 2, 2, 5]], np.int32))
    weight = layer.weight.asnumpy()
    np.testing.assert_array_equal(layer(ids).asnumpy(), weight[ids.asnumpy()])
    grad = ms.grad(lambda i: layer(i).sum(), None, layer.trainable_params())(ids)[0].asnumpy()
    np.testing.assert_array_equal(grad[:, 0], [0, 0, 2, 0, 0, 1])  # row 0 (padding) gets nothing


def test_layer_norm_and_conv3d_equal_numpy():
    x = f32(2, 5, 8)
    norm = mint.nn.LayerNorm(8, eps=1e-6)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(norm(ms.Tensor(x)).asnumpy(), (x - mean) / np.sqrt(var + 1e-6), atol=1e-5)
    conv = mint.nn.Conv3d(3, 4, kernel_size=(2, 2, 2), stride=(2, 2, 2), bias=True)
    images = f32(5, 3, 2, 2, 2, seed=2)
    weight, bias = conv.weight.asnumpy(), conv.bias.asnumpy()
    expected = np.einsum("nczyx,oczyx->no", images, weight) + bias
    np.testing.assert_allclose(conv(ms.Tensor(images)).asnumpy().reshape(5, 4), expected, atol=1e-5)


def test_adopt_converts_layers_built_from_the_original_classes():
    original = nn.LayerNormExt  # what mint.nn.LayerNorm was before the stand-ins
    cell = nn.SequentialCell(original(8, eps=1e-6))
    assert cpu_ops.adopt(cell) == 1
    assert type(cell[0]) is cpu_ops.LayerNorm
    x = f32(3, 8)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(cell(ms.Tensor(x)).asnumpy(), want, atol=1e-5)


def shifted_range(n):
    return mint.arange(0, 4) + n


def test_stand_ins_compile():
    """They run inside mindspore.jit too (what the graph executor does with a chunk)."""
    np.testing.assert_array_equal(ms.jit(shifted_range)(ms.Tensor(1)).asnumpy(), [1, 2, 3, 4])
    weight = ms.Tensor(f32(5, 2))
    out = ms.jit(cpu_ops.embedding)(ms.Tensor(np.array([1, 3], np.int32)), weight)
    np.testing.assert_array_equal(out.asnumpy(), weight.asnumpy()[[1, 3]])
    norm = mint.nn.LayerNorm(4)
    x = ms.Tensor(f32(2, 4))
    np.testing.assert_allclose(ms.jit(norm)(x).asnumpy(), norm(x).asnumpy(), atol=1e-6)
