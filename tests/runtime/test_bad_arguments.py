"""Bad arguments to the public API: each is refused with an error that names the bad value and
what is allowed, before any work or communication, and leaves the schedule usable."""

from __future__ import annotations

import re

import numpy as np
import pytest
from mindspore import Tensor

import graph_exec as ge
from graph_exec.errors import GraphExecError
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build


def local_stages(model) -> list:
    return [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]


@pytest.fixture(scope="module")
def model():
    return build(2, "trainable")


def make(model, micro=2, pre="model", layers=1, **options):
    pre = model.preprocess if pre == "model" else pre
    options.setdefault("loss_fn", loss_fn)
    return ge.ScheduleMPipeTranspose(local_stages(model), micro, pre, layers, **options)


@pytest.mark.parametrize("micro", [0, -1, 2.0, True, "4", None])
def test_micro_batch_num_must_be_a_positive_int(model, micro) -> None:
    with pytest.raises(ValueError, match=rf"micro_batch_num must be a positive int, got {micro!r}"):
        make(model, micro=micro)
    with pytest.raises(ValueError, match="micro_batch_num must be a positive int"):
        ge.ScheduleInterleaved1F1B(local_stages(build(2, "none")), micro, loss_fn=loss_fn)


@pytest.mark.parametrize("layers", [-1, 1.5, True, "1"])
def test_num_transpose_layers_must_be_an_int_at_least_zero(model, layers) -> None:
    with pytest.raises(ValueError, match=rf"num_transpose_layers must be an int >= 0, got {layers!r}"):
        make(model, layers=layers)


def test_preprocess_module_and_layers_go_together(model) -> None:
    with pytest.raises(ValueError, match=r"num_transpose_layers=1 with preprocess_module=None"):
        make(model, pre=None, layers=1)
    with pytest.raises(ValueError, match=r"num_transpose_layers=0 with preprocess_module=Projector"):
        make(model, layers=0)
    with pytest.raises(TypeError, match=r"preprocess_module must be a mindspore\.nn\.Cell, got function"):
        make(model, pre=loss_fn)


@pytest.mark.parametrize("bad", ["cross_entropy", 3])
def test_loss_fn_must_be_callable(model, bad) -> None:
    with pytest.raises(TypeError, match=rf"loss_fn must be callable or None, got {type(bad).__name__}"):
        make(model, loss_fn=bad)


@pytest.mark.parametrize("timeout", [0, -5, "60", True, float("nan")])
def test_timeout_must_be_positive_seconds(model, timeout) -> None:
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds > 0, got"):
        make(model, timeout_s=timeout)


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("mode", "eager", "'graph', 'pynative'"),
        ("run_ahead", "max", "'full', 'min'"),
        ("backward", "local", "'central', 'owner'"),
        ("input", "sharded", "'replicated', 'owned'"),
    ],
)
def test_choices_name_the_allowed_values(model, option, value, allowed) -> None:
    with pytest.raises(ValueError, match=rf"{option} must be one of {allowed}, got '{value}'"):
        make(model, **{option: value})


@pytest.mark.parametrize("value", [-1, 1.5, True, "1GiB", None])
def test_buffer_cache_bytes_must_be_an_int_at_least_zero(model, value) -> None:
    with pytest.raises(
        ValueError, match=rf"buffer_cache_bytes must be an int >= 0, got {re.escape(repr(value))}"
    ):
        make(model, buffer_cache_bytes=value)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_keep_preprocess_tape_must_be_a_bool(model, value) -> None:
    with pytest.raises(
        ValueError, match=rf"keep_preprocess_tape must be a bool \(True or False\), got {value!r}"
    ):
        make(model, keep_preprocess_tape=value)


@pytest.mark.parametrize("preprocess", ["frozen", "none"])
def test_keep_preprocess_tape_needs_a_trainable_preprocess(preprocess) -> None:
    model = build(2, preprocess)
    layers = 0 if model.preprocess is None else 1
    with pytest.raises(ValueError, match=rf"keep_preprocess_tape=True needs a trainable .* is {preprocess}"):
        make(model, pre=model.preprocess, layers=layers, keep_preprocess_tape=True)


def test_keep_preprocess_tape_contradicts_recompute(model) -> None:
    with pytest.raises(ValueError, match=r"keep_preprocess_tape=True and recompute=True contradict"):
        make(model, keep_preprocess_tape=True, recompute=True)


def test_stages_are_checked(model) -> None:
    with pytest.raises(TypeError, match="non-empty sequence of PipelineStage"):
        ge.ScheduleMPipeTranspose([], 2)
    with pytest.raises(TypeError, match="non-empty sequence of PipelineStage"):
        ge.ScheduleMPipeTranspose([model.stages[0]], 2)
    twice = [ge.PipelineStage(model.stages[0], 0, 2), ge.PipelineStage(model.stages[1], 0, 2)]
    with pytest.raises(ValueError, match=r"stage indices repeat on this rank: \[0, 0\]"):
        ge.ScheduleMPipeTranspose(twice, 2)
    mixed = [ge.PipelineStage(model.stages[0], 0, 2), ge.PipelineStage(model.stages[1], 1, 3)]
    with pytest.raises(ValueError, match=r"disagree on num_stages: \[2, 3\]"):
        ge.ScheduleMPipeTranspose(mixed, 2)
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, 2\), got 2"):
        ge.PipelineStage(model.stages[0], 2, 2)


def test_results_before_the_first_run_are_refused(model) -> None:
    sched = make(model)
    for what, read in [("grads()", sched.grads), ("stats()", sched.stats), ("plan", lambda: sched.plan)]:
        with pytest.raises(GraphExecError, match=re.escape(f"{what} is available after the first run()")):
            read()
    assert sched.timeline == []


def test_bad_inputs_are_refused_before_any_step_and_leave_the_schedule_usable() -> None:
    model = build(2, "trainable")
    sched = make(model, micro=2)
    x, labels = batch(8)
    cases = [
        (
            TypeError,
            r"input 0 must be a mindspore.Tensor or a numpy.ndarray, got list",
            ([[0.0]] * 8,),
            {"labels": labels},
        ),
        (
            TypeError,
            r"label 0 must be a mindspore.Tensor or a numpy.ndarray, got list",
            (x,),
            {"labels": [[0] * 8]},
        ),
        (ValueError, r"input 0 is a 0-d tensor", (Tensor(np.float32(1)),), {"labels": labels}),
        (ValueError, r"label 0 has batch size 6 but input 0 has 8", (x,), {"labels": labels[:6]}),
        (ValueError, r"run\(\) needs at least one input tensor", (), {"labels": labels}),
        (ValueError, r"labels are required", (x,), {}),
        (ValueError, r"batch size 7 .* not divisible by micro_batch_num=2", (x[:7],), {"labels": labels[:7]}),
        (
            ValueError,
            r"batch size 1 \(dim 0 of input 0\) is smaller than micro_batch_num=2: every micro-batch",
            (x[:1],),
            {"labels": labels[:1]},
        ),
        (ValueError, r"batch size 0 .* is smaller than micro_batch_num=2", (x[:0],), {"labels": labels[:0]}),
    ]
    for error, message, args, kwargs in cases:
        with pytest.raises(error, match=message):
            sched.run(*args, **kwargs)
    with pytest.raises(GraphExecError):  # nothing was set up by the refused calls
        sched.grads()
    losses = sched.run(x, labels=labels)
    assert len(losses) == 2 and all(np.isfinite(float(loss.asnumpy())) for loss in losses)


def test_keyword_inputs_need_a_preprocess() -> None:
    model = build(2, "none")
    sched = ge.ScheduleMPipeTranspose(local_stages(model), 2, loss_fn=loss_fn)
    x, labels = batch(4)
    with pytest.raises(
        ValueError, match=r"keyword inputs \['mask'\] go to the preprocess module, but there is none"
    ):
        sched.run(x, labels=labels, mask=x)
