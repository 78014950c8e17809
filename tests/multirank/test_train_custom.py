"""examples/train_custom.py under msrun at 2 ranks trains exactly like a non-pipelined run.

The script is launched as a user would (msrun, a free port, GLOG_v unset by us: the launcher's
default). The last stage's rank prints the mean loss of every step; the reference trains the
same model (same seed, same batches, same Adam) in this process without pipelining, with the
gradient of the mean over micro-batches, clipped by its global norm as the script's
``sched.step(optimizer, max_norm=...)`` clips (``MAX_NORM`` is small enough that every step
clips). Losses agree to atol 1e-5 / rtol 1e-4 (the script
prints six decimals). Every step after the first depends on every gradient of the one before,
so a wrong gradient anywhere shows up in the next loss.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import graph_exec.examples.train_custom as example
from graph_exec.launch import launch

STEPS, VPP, MICRO, BATCH, LR, MAX_NORM = 4, 2, 4, 16, 1e-2, 0.05


def reference_losses(num_stages: int) -> list[float]:
    import mindspore as ms
    from mindspore import Tensor, nn

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    model = example.TinyClassifier(num_stages, seed=0)
    params = model.trainable_params()
    rows = BATCH // MICRO

    def mean_loss(tokens, labels):
        total = 0.0
        for m in range(MICRO):
            piece = slice(m * rows, (m + 1) * rows)
            total = total + example.cross_entropy(model(tokens[piece]), labels[piece])
        return total / MICRO

    step = ms.value_and_grad(mean_loss, grad_position=None, weights=params)
    optimizer = nn.Adam(params, learning_rate=LR)
    losses = []
    for index in range(STEPS):
        tokens, labels = example.make_batch(index, BATCH)
        loss, grads = step(Tensor(tokens), Tensor(labels))
        norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
        assert norm > MAX_NORM, "the reference must clip for the comparison to check clipping"
        optimizer(tuple(g * (MAX_NORM / (norm + 1e-6)) for g in grads))
        losses.append(float(loss.asnumpy()))
    return losses


def test_example_under_msrun_matches_the_non_pipelined_run(tmp_path: Path) -> None:
    args = ["--steps", str(STEPS), "--vpp", str(VPP), "--micro", str(MICRO), "--batch", str(BATCH)]
    args += ["--lr", str(LR), "--max-norm", str(MAX_NORM)]
    result = launch(example.__file__, args, nproc=2, log_dir=tmp_path / "logs", timeout_s=240)
    if not result.ok:
        pytest.fail(result.describe(), pytrace=False)
    printed = re.findall(r"^step (\d+) loss (\S+)$", result.worker_logs[1], flags=re.MULTILINE)
    assert [int(k) for k, _ in printed] == list(range(1, STEPS + 1)), result.worker_logs[1]
    assert "loss" not in result.worker_logs[0]  # only the last stage's rank has losses
    for rank, log in result.worker_logs.items():
        assert "[ERROR]" not in log, f"rank {rank} logged an error:\n{log}"
    expected = reference_losses(2 * VPP)
    np.testing.assert_allclose([float(v) for _, v in printed], expected, atol=1e-5, rtol=1e-4)
    assert len(set(expected)) == STEPS  # training moves the loss: the comparison is not vacuous
