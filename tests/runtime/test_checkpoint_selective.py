"""graph_exec.checkpoint.selective: the chosen tensors of a MindSpore ``.ckpt`` file, read without
the others, equal what ``mindspore.load_checkpoint`` reads (dtype, shape, every element), also for
a tensor MindSpore saved in slices, bfloat16 and a scalar."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore.train import serialization

from graph_exec.checkpoint import selective


def as_numpy(value) -> np.ndarray:
    return (value.float() if value.dtype == ms.bfloat16 else value).asnumpy()


def test_chosen_tensors_equal_mindspores_own_reading_and_only_they_are_read(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    tensors = {
        "w": ms.Tensor(rng.random((40, 30), dtype=np.float32)),  # 4800 bytes: 5 slices below
        "b16": ms.Tensor(rng.random(7), ms.bfloat16),
        "step": ms.Tensor(5, ms.int32),
        "h": ms.Tensor(rng.random((4, 4)).astype(np.float16)),
        "generator": ms.get_rng_state(),
    }
    monkeypatch.setattr(serialization, "SLICE_SIZE", 1)  # KiB: a tensor over 1 KiB is saved in slices
    path = str(tmp_path / "x.ckpt")
    ms.save_checkpoint([{"name": k, "data": v} for k, v in tensors.items()], path)
    expected = ms.load_checkpoint(path)
    found, _ = selective.read(path, set(tensors))
    assert sorted(found) == sorted(tensors)
    for name, value in expected.items():
        assert (found[name].dtype, found[name].shape) == (value.dtype, value.shape), name
        np.testing.assert_array_equal(as_numpy(found[name]), as_numpy(value), err_msg=name)
    some, count = selective.read(path, {"h", "step", "absent"})
    assert sorted(some) == ["h", "step"]
    assert 16 * 2 + 4 <= count < 400  # two small records and five names, not the 5 KiB of w


def test_a_file_that_is_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"\x12\x05hello")
    with pytest.raises(ValueError, match=r"not a MindSpore \.ckpt file"):
        selective.read(str(path), {"a"})
