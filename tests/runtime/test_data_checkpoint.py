"""The data loader's position in a checkpoint (one process): a resumed job reads exactly the
batches an uninterrupted one reads next, so its losses and final parameters equal the
uninterrupted run's (atol 1e-6: same operations, same order)."""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import nn

import graph_exec as ge
from graph_exec.checkpoint import CheckpointMismatchError
from graph_exec.data import DataLoader
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build

ATOL = 1e-6


def data_set() -> list[tuple[np.ndarray, np.ndarray]]:
    x, labels = batch(40, seed=21)  # 40 samples, 5 batches of 8 per epoch
    return list(zip(x.asnumpy(), labels.asnumpy(), strict=True))


class Job:
    def __init__(self, seed: int = 0) -> None:
        self.model = build(3, "trainable", seed=seed)
        chunks = [ge.PipelineStage(c, k, 3) for k, c in enumerate(self.model.stages)]
        self.sched = ge.ScheduleMPipeTranspose(
            chunks, 2, self.model.preprocess, 1, loss_fn=loss_fn, mode="pynative"
        )
        self.opt = nn.Adam(self.sched.trainable_params(), learning_rate=1e-2)
        self.loader = DataLoader(data_set(), 8, seed=5)

    def train(self, steps: int) -> list[list[float]]:
        losses = []
        for _ in range(steps):
            x, labels = self.loader.next_batch()
            losses.append([float(v.asnumpy()) for v in self.sched.run(x, labels=labels)])
            self.sched.step(self.opt)
        return losses


def test_a_resumed_job_continues_with_the_next_batch(tmp_path):
    uninterrupted = Job()
    expected = uninterrupted.train(8)  # across an epoch boundary (5 batches per epoch)
    first = Job()
    first.train(4)
    ge.save_checkpoint(first.sched, tmp_path, 4, optimizer=first.opt, data=first.loader)
    resumed = Job(seed=7)
    assert ge.load_checkpoint(resumed.sched, tmp_path, optimizer=resumed.opt, data=resumed.loader) == 4
    assert (resumed.loader.epoch, resumed.loader.step) == (0, 4)
    np.testing.assert_allclose(resumed.train(4), expected[4:], atol=ATOL, rtol=0)


def test_loading_a_position_that_was_not_saved_is_refused_before_anything_changes(tmp_path):
    first = Job()
    first.train(2)
    ge.save_checkpoint(first.sched, tmp_path, 2, optimizer=first.opt)
    other = Job(seed=7)
    before = {p.name: p.asnumpy().copy() for p in other.sched.trainable_params()}
    with pytest.raises(CheckpointMismatchError, match="holds no data-loader position"):
        ge.load_checkpoint(other.sched, tmp_path, optimizer=other.opt, data=other.loader)
    for p in other.sched.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name])


def test_a_loader_set_up_differently_is_refused(tmp_path):
    first = Job()
    first.train(1)
    ge.save_checkpoint(first.sched, tmp_path, 1, optimizer=first.opt, data=first.loader)
    other = Job(seed=7)
    other.loader = DataLoader(data_set(), 8, seed=6)
    with pytest.raises(CheckpointMismatchError, match=r"seed 5 \(now 6\)"):
        ge.load_checkpoint(other.sched, tmp_path, optimizer=other.opt, data=other.loader)
    assert other.loader.step == 0
