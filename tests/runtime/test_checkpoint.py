"""Checkpoint and resume on one process (P = 1, every stage local, no communication).

Exact resume is checked the way the multi-rank test does it, on a small scale: run A trains
6 steps with Adam; run B trains 3 and saves; run C, built from *another* seed so that only
the checkpoint can make it right, loads step 3 and trains 3 more. C's losses and final
parameters must equal A's steps 4-6 (atol 1e-6). The fault cases check that a bad or foreign
checkpoint raises a clear error before any parameter changes.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import graph_exec as ge
from graph_exec.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ReshardWarning,
    layout,
)
from graph_exec.checkpoint.state import RNG_STATE, SCALER_PREFIX
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build

ATOL = 1e-6  #: resumed vs uninterrupted training: same operations, same order
LR = 1e-2


class Job:
    """A model, its schedule and an Adam optimizer, as one training process would hold them."""

    def __init__(self, preprocess="trainable", stages=3, seed=0, baseline=False, **options):
        self.model = build(stages, preprocess, seed=seed)
        chunks = [ge.PipelineStage(c, k, stages) for k, c in enumerate(self.model.stages)]
        if baseline:
            self.sched = ge.ScheduleInterleaved1F1B(chunks, 2, loss_fn=loss_fn, **options)
        else:
            layers = 0 if self.model.preprocess is None else 1
            self.sched = ge.ScheduleMPipeTranspose(
                chunks, 2, self.model.preprocess, layers, loss_fn=loss_fn, **options
            )
        self.params = self.sched.trainable_params()
        self.opt = nn.Adam(self.params, learning_rate=LR)

    def train(self, first, count):
        losses = []
        for step in range(first, first + count):
            x, labels = batch(8, seed=100 + step)
            out = self.sched.run(x, labels=labels)
            losses.append([float(v.asnumpy()) for v in out])
            self.opt(tuple(self.sched.grads().values()))
            self.sched.zero_grad()
        return np.array(losses)

    def values(self):
        cells = [*self.model.stages, *([self.model.preprocess] if self.model.preprocess else [])]
        return {p.name: p.asnumpy().copy() for c in cells for p in c.get_parameters()}

    def save(self, directory, step, **kw):
        return ge.save_checkpoint(self.sched, directory, step, optimizer=self.opt, **kw)

    def load(self, directory, **kw):
        return ge.load_checkpoint(self.sched, directory, optimizer=self.opt, **kw)


def assert_same_values(a, b, atol=ATOL):
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=atol, rtol=0, err_msg=name)


@pytest.mark.parametrize(
    ("preprocess", "options"),
    [
        ("trainable", {"mode": "graph"}),
        ("frozen", {"mode": "pynative"}),
        ("none", {"mode": "graph", "baseline": True}),
    ],
    ids=["trainable-graph", "frozen-pynative", "baseline-graph"],
)
def test_resume_continues_exactly(tmp_path, preprocess, options):
    a = Job(preprocess, **options)
    losses_a = a.train(0, 6)
    b = Job(preprocess, **options)
    b.train(0, 3)
    saved = b.save(tmp_path, 3)
    assert saved.path == tmp_path / "step_3" and saved.bytes > 0 and saved.total_bytes == saved.bytes
    c = Job(preprocess, seed=7, **options)  # other weights: only the checkpoint can make C right
    assert c.load(tmp_path) == 3  # before the first run()
    np.testing.assert_allclose(c.train(3, 3), losses_a[3:], atol=ATOL, rtol=0)
    assert_same_values(c.values(), a.values())


def test_the_loss_scalers_state_is_saved_and_resumed(tmp_path):
    # scale_window=2: the scale doubles every second finite step, so after three steps neither
    # the scale nor the counter is the scaler's initial one.
    def scaler():
        return ms.amp.DynamicLossScaler(2.0**10, 2, 2)

    a = Job("trainable", loss_scaler=scaler())
    losses_a = a.train(0, 5)
    b = Job("trainable", loss_scaler=scaler())
    b.train(0, 3)
    b.save(tmp_path, 3)
    stored = ms.load_checkpoint(str(tmp_path / "step_3" / "rank_0.ckpt"))
    assert float(stored[SCALER_PREFIX + "scale_value"].asnumpy()) == 2.0**11
    assert int(stored[SCALER_PREFIX + "counter"].asnumpy()) == 1
    c = Job("trainable", seed=7, loss_scaler=scaler())
    c.load(tmp_path)
    assert float(c.sched.loss_scaler.scale_value.asnumpy()) == 2.0**11
    assert int(c.sched.loss_scaler.counter.asnumpy()) == 1
    np.testing.assert_allclose(c.train(3, 2), losses_a[3:], atol=ATOL, rtol=0)
    assert float(c.sched.loss_scaler.scale_value.asnumpy()) == float(
        a.sched.loss_scaler.scale_value.asnumpy()
    )
    d = Job("trainable", seed=7)  # no scaler: the checkpoint's scaler state does not fit
    with pytest.raises(CheckpointMismatchError, match="loss_scaler"):
        d.load(tmp_path)


def draws(count):
    """What MindSpore's random operators that take a seed and an offset (``mint``'s, on Ascend)
    get from the default generator: ``count`` (seed, offset) pairs, each advancing it."""
    step = ms.Tensor(12, ms.int64)
    return [tuple(int(v) for v in ms.default_generator._step(step)) for _ in range(count)]


def test_the_random_generator_state_is_saved_and_restored(tmp_path):
    job = Job("none")
    ms.manual_seed(11)
    uninterrupted = draws(5)
    ms.manual_seed(11)
    draws(2)  # two steps' worth of random numbers drawn before the checkpoint
    job.save(tmp_path, 2)
    ms.manual_seed(99)  # a new process: another seed, offset 0
    draws(1)
    Job("none", seed=3).load(tmp_path)
    assert ms.default_generator.initial_seed() == 11
    assert draws(3) == uninterrupted[2:]


def test_nn_dropout_on_cpu_does_not_draw_from_the_generator():
    """Why the generator state does not resume nn.Dropout on CPU (docs/restarts.md): its
    kernel keeps a generator of its own. If this fails, MindSpore changed: update the docs."""
    ms.set_seed(1)
    dropout = nn.Dropout(p=0.5)
    dropout.set_train(True)
    x = ms.Tensor(np.ones((4, 16), np.float32))
    state = ms.get_rng_state()
    first = dropout(x).asnumpy()
    ms.set_rng_state(state)
    assert not np.array_equal(dropout(x).asnumpy(), first)


def test_a_checkpoint_without_a_generator_state_still_loads(tmp_path):
    """Files written before the generator state was saved: the generator is left as it is."""
    job = Job("none")
    job.save(tmp_path, 1)
    path = tmp_path / "step_1" / "rank_0.ckpt"
    stored = ms.load_checkpoint(str(path))
    del stored[RNG_STATE]
    ms.save_checkpoint([{"name": k, "data": v} for k, v in stored.items()], str(path))
    manifest = json.loads((tmp_path / "step_1" / "complete.json").read_text())
    manifest["ranks"][0]["sha256"] = layout.sha256_of(path)
    layout.write_json_atomically(tmp_path / "step_1" / "complete.json", manifest)
    ms.manual_seed(7)
    before = ms.get_rng_state().asnumpy().tobytes()
    assert job.load(tmp_path) == 1
    assert ms.get_rng_state().asnumpy().tobytes() == before


def test_checkpoint_contents_and_manifest(tmp_path):
    job = Job("frozen", stages=3)
    job.train(0, 1)
    job.save(tmp_path, 1)
    manifest = json.loads((tmp_path / "step_1" / "complete.json").read_text())
    assert manifest["world_size"] == 1 and manifest["mesh"] == {"dp": 1, "pp": 1}
    assert manifest["num_stages"] == 3 and manifest["vpp"] == 3 and manifest["preprocess"] == "frozen"
    assert manifest["stage_ranks"] == {"0": [0], "1": [0], "2": [0]}
    assert manifest["options"]["run_ahead"] == "full" and manifest["options"]["micro_batch_num"] == 2
    (entry,) = manifest["ranks"]
    assert entry["file"] == "rank_0.ckpt" and entry["stages"] == [0, 1, 2]
    assert entry["facts"]["preprocess"] == "frozen" and entry["sha256"] == layout.sha256_of(
        tmp_path / "step_1" / "rank_0.ckpt"
    )
    # MindSpore's own reader: frozen preprocess weights and Adam's state are in the file.
    stored = ms.load_checkpoint(str(tmp_path / "step_1" / "rank_0.ckpt"))
    assert {"pre.a.weight", "s0.a.weight", "moment1.s2.out.weight", "beta1_power"} <= set(stored)
    np.testing.assert_array_equal(stored["pre.a.weight"].asnumpy(), job.model.preprocess.a.weight.asnumpy())
    assert sorted(entry["optimizer"]) == sorted(k for k in stored if k not in job.values() and k != RNG_STATE)
    assert stored[RNG_STATE].asnumpy().tobytes() == ms.get_rng_state().asnumpy().tobytes()
    assert not list((tmp_path / "step_1").glob(".*"))  # no temporary file left behind


def test_keep_deletes_old_checkpoints_only_after_a_newer_one_completes(tmp_path):
    job = Job("none")
    (tmp_path / "step_0").mkdir()  # debris of a save that died
    job.save(tmp_path, 1, keep=2)
    job.save(tmp_path, 2, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
    saved = job.save(tmp_path, 3, keep=2)
    assert saved.removed == (1,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    job.save(tmp_path, 4, keep=None)
    assert ge.latest_checkpoint(tmp_path) == 4 and len(list(tmp_path.iterdir())) == 3


def test_saving_twice_to_a_step_is_refused(tmp_path):
    job = Job("none")
    job.save(tmp_path, 2)
    with pytest.raises(CheckpointExistsError, match=r"step 2 already exists .*step_2"):
        job.save(tmp_path, 2)
    with pytest.raises(
        CheckpointError, match=r"step 1 is older than the latest complete checkpoint .*step 2"
    ):
        job.save(tmp_path, 1)


def test_bad_arguments_are_named(tmp_path):
    job = Job("none")
    with pytest.raises(ValueError, match=r"step must be >= 0.*got -1"):
        job.save(tmp_path, -1)
    with pytest.raises(TypeError, match=r"step must be an int.*got True"):
        job.save(tmp_path, True)
    with pytest.raises(ValueError, match=r"keep must be an int >= 1.*got 0"):
        job.save(tmp_path, 1, keep=0)
    with pytest.raises(TypeError, match=r"optimizer must be a mindspore.nn.Cell"):
        ge.save_checkpoint(job.sched, tmp_path, 1, optimizer="adam")
    with pytest.raises(ValueError, match=r"step must be >= 0.*got -2"):
        job.load(tmp_path, step=-2)
    assert not list(tmp_path.iterdir())


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(
        CheckpointError, match=r"rank 0 cannot create checkpoint directory .*a_file/ckpt/step_1"
    ):
        Job("none").save(blocker / "ckpt", 1)


def test_missing_rank_file_makes_the_step_incomplete(tmp_path):
    job = Job("trainable")
    job.save(tmp_path, 1)
    before = job.values()
    job.train(1, 1)
    job.save(tmp_path, 2)
    (tmp_path / "step_2" / "rank_0.ckpt").unlink()
    with pytest.warns(UserWarning, match=r"incomplete checkpoint step 2 .*rank_0.ckpt"):
        assert job.load(tmp_path) == 1
    assert_same_values(job.values(), before, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            CheckpointNotFoundError, match=r"step 2 in .* is not complete.*complete steps: \[1\]"
        ):
            job.load(tmp_path, step=2)


def damage_file(path, damage):
    data = bytearray(path.read_bytes())
    path.chmod(0o600)
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_damaged_rank_file_names_file_and_rank_and_loads_nothing(tmp_path, damage):
    job = Job("trainable")
    job.save(tmp_path, 1)
    job.train(1, 1)
    job.save(tmp_path, 2)
    damage_file(tmp_path / "step_2" / "rank_0.ckpt", damage)
    fresh = Job("trainable", seed=3)
    before = fresh.values()
    with pytest.raises(
        CheckpointCorruptError, match=r"step_2/rank_0.ckpt \(rank 0's file of step 2\).*step=.*\[1, 2\]"
    ):
        fresh.load(tmp_path, step=2)  # asked for by name: no fallback
    assert_same_values(fresh.values(), before, atol=0)
    assert fresh.load(tmp_path, step=1) == 1  # the way out the message names


def test_a_corrupt_latest_step_falls_back_to_the_previous_complete_one(tmp_path):
    job = Job("trainable")
    job.train(0, 1)
    job.save(tmp_path, 1)
    at_step_1 = job.values()
    job.train(1, 1)
    job.save(tmp_path, 2)  # keep=2: step 1 stays
    damage_file(tmp_path / "step_2" / "rank_0.ckpt", "corrupted")
    with pytest.warns(
        UserWarning, match=r"skipping corrupt checkpoint step 2 .*rank_0.ckpt does not match the checksum"
    ):
        assert ge.latest_checkpoint(tmp_path) == 1  # what a launcher sees: the same step
    fresh = Job("trainable", seed=3)
    with pytest.warns(UserWarning) as seen:
        assert fresh.load(tmp_path) == 1
    (message,) = [str(w.message) for w in seen]
    assert (
        "checkpoint step 2" in message
        and "rank 0" in message
        and "loading the previous complete step 1" in message
    )
    assert_same_values(fresh.values(), at_step_1, atol=0)
    # set aside, not deleted: the job saves step 2 again, and the damaged file stays to inspect
    assert (tmp_path / "step_2.corrupt" / "rank_0.ckpt").is_file() and not (tmp_path / "step_2").exists()
    fresh.train(1, 1)
    fresh.save(tmp_path, 2)
    assert ge.latest_checkpoint(tmp_path) == 2


def test_a_corrupt_only_step_is_an_error(tmp_path):
    job = Job("none")
    job.save(tmp_path, 1)
    damage_file(tmp_path / "step_1" / "rank_0.ckpt", "corrupted")
    with pytest.raises(CheckpointCorruptError, match=r"rank 0's file of step 1"):
        Job("none", seed=2).load(tmp_path)
    assert (tmp_path / "step_1").is_dir()  # nothing to fall back to: left where it is


def test_another_model_is_refused_naming_it_before_loading(tmp_path):
    Job("trainable", stages=3).save(tmp_path, 1)
    other = Job("trainable", stages=4)  # s2 is a Hidden block now (the Head's place before)
    before = other.values()
    with pytest.raises(CheckpointMismatchError) as info:
        other.load(tmp_path)
    text = str(info.value)
    assert "does not fit rank 0's model" in text and "written for another model?): s2.a.bias" in text, text
    assert_same_values(other.values(), before, atol=0)


def test_schedule_options_are_recorded_and_a_change_is_said_then_loaded_by_name(tmp_path):
    job = Job("none")
    job.sched.stage_split = "even"  # what a schedule option added later looks like
    job.save(tmp_path, 1)
    assert json.loads((tmp_path / "step_1" / "complete.json").read_text())["options"]["stage_split"] == "even"
    job.sched.stage_split = None
    with pytest.warns(ReshardWarning, match="option stage_split: checkpoint 'even', this job None"):
        assert job.load(tmp_path) == 1
    job.sched.stage_split = "even"
    saved = job.sched.options
    execution_only = (
        {"mode": "pynative", "recompute": True, "jit_options": {"jit_level": "O1"}},
        {"keep_preprocess_tape": True},
    )
    for changes in execution_only:  # recorded, not compared: no warning
        job.sched.options = replace(saved, **changes)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReshardWarning)
            assert job.load(tmp_path) == 1
    job.sched.options = replace(saved, shapes="dynamic")
    with pytest.warns(ReshardWarning, match="option shapes: checkpoint 'static', this job 'dynamic'"):
        assert job.load(tmp_path) == 1


def test_optimizer_state_must_be_in_the_checkpoint_when_asked_for(tmp_path):
    job = Job("none")
    ge.save_checkpoint(job.sched, tmp_path, 1)  # weights only
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
        job.load(tmp_path)
    assert ge.load_checkpoint(job.sched, tmp_path) == 1


def test_nothing_to_load(tmp_path):
    assert ge.latest_checkpoint(tmp_path / "nowhere") is None
    (tmp_path / "step_5").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            CheckpointNotFoundError, match=r"no complete checkpoint .*incomplete steps.*\[5\]"
        ):
            Job("none").load(tmp_path)


def test_checkpoint_survives_a_copy(tmp_path):
    """A checkpoint directory is self-contained: copied elsewhere, it loads the same."""
    job = Job("frozen")
    job.train(0, 2)
    job.save(tmp_path / "a", 2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    other = Job("frozen", seed=5)
    assert other.load(tmp_path / "b") == 2
    assert_same_values(other.values(), job.values(), atol=0)


def test_a_resuming_worker_says_which_step_it_loads_before_loading(monkeypatch, capsys, tmp_path):
    """So that a load failing on every rank is reported in the step after the checkpoint."""
    from types import SimpleNamespace

    from graph_exec.cli.jobs import steps_finished
    from graph_exec.harness.training import Trainer

    def corrupt(*args, **kwargs):
        raise CheckpointCorruptError("rank_1.ckpt does not match")

    monkeypatch.setattr(ge, "load_checkpoint", corrupt)
    worker = SimpleNamespace(
        spec=SimpleNamespace(name="run"),
        job=SimpleNamespace(batch=8),
        schedule=None,
        optimizer=None,
        loader=None,
        _checkpoint_dir=lambda: tmp_path,
    )
    with pytest.raises(CheckpointCorruptError):
        Trainer.resume(worker, 4)
    assert steps_finished(capsys.readouterr().out) == 4
