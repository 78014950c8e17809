"""The schedules' keyword options (graph_exec/runtime/options.py): declared once for both
schedules, the old name ``overflow`` still accepted with a warning, the MPipe-only options
refused by the fair baseline, ``jit_options`` checked and handed to every ``mindspore.jit``."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import amp, nn

import graph_exec as ge
from graph_exec.device import policy
from graph_exec.executors import kernel_executor
from graph_exec.executors.jit_options import JIT_OPTIONS
from graph_exec.runtime.options import MPIPE_ONLY, ScheduleOptions, option_names
from tests.models.common import ATOL, RTOL, loss_fn
from tests.models.pipeline import batch, build, reference


def stages_of(model) -> list:
    return [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]


@pytest.fixture(scope="module")
def model():
    return build(2, "trainable")


def mpipe(model, **options):
    return ge.ScheduleMPipeTranspose(stages_of(model), 2, model.preprocess, 1, loss_fn=loss_fn, **options)


def test_overflow_is_the_deprecated_name_of_run_ahead(model) -> None:
    with pytest.warns(DeprecationWarning, match=r"overflow= is now called run_ahead=") as caught:
        sched = mpipe(model, overflow="min")
    assert sched.run_ahead == "min" and sched.options.run_ahead == "min"
    assert caught[0].filename == __file__  # points at the caller, not into the library
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mpipe(model, run_ahead="min").run_ahead == "min"
    with pytest.raises(TypeError, match=r"pass run_ahead= or its old name overflow=, not both"):
        mpipe(model, overflow="min", run_ahead="min")
    bad = pytest.raises(ValueError, match=r"overflow must be one of 'full', 'min', got 'max'")
    with bad, pytest.warns(DeprecationWarning):
        mpipe(model, overflow="max")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("overflow", "min"),
        ("run_ahead", "full"),
        ("backward", "owner"),
        ("input", "owned"),
        ("keep_preprocess_tape", False),
    ],
)
def test_the_baseline_refuses_the_options_that_need_transposition(model, option, value) -> None:
    with pytest.raises(
        TypeError, match=rf"ScheduleInterleaved1F1B does not transpose .* {option} do not apply"
    ):
        ge.ScheduleInterleaved1F1B(
            stages_of(model), 2, model.preprocess, 1, loss_fn=loss_fn, **{option: value}
        )


@pytest.mark.parametrize(
    ("pre", "options", "error"),
    [
        (
            "frozen",
            {"backward": "owner"},
            r"backward 'owner' needs preprocess 'trainable', got preprocess 'frozen'",
        ),
        ("none", {"backward": "owner"}, r"backward 'owner' needs preprocess 'trainable'.*"),
        (
            "trainable",
            {"backward": "owner"},
            r"backward 'owner' needs a peer rank, but pp=1.*use backward 'central'",
        ),
        (
            "trainable",
            {"input": "owned"},
            r"input 'owned' needs a peer rank, but pp=1.*use input 'replicated'",
        ),
        ("trainable", {"body": "1f1b"}, r"body '1f1b' .* needs vpp=1, got vpp=2; use body 'interleaved'"),
    ],
)
def test_options_the_plan_cannot_take_together_are_refused_at_construction(pre, options, error) -> None:
    # One process holding both stages: P = 1, V = 2, known before any run() (which used to be
    # where these failed, once communication and the mesh were set up).
    model = build(2, pre)
    layers = 0 if pre == "none" else 1
    with pytest.raises(ValueError, match=error):
        ge.ScheduleMPipeTranspose(stages_of(model), 2, model.preprocess, layers, loss_fn=loss_fn, **options)


def test_the_baseline_refuses_a_plain_1f1b_body_over_two_chunks_at_construction(model) -> None:
    with pytest.raises(ValueError, match=r"body '1f1b' .* needs vpp=1, got vpp=2"):
        ge.ScheduleInterleaved1F1B(stages_of(model), 2, model.preprocess, 1, loss_fn=loss_fn, body="1f1b")


def test_an_unknown_option_is_refused_with_the_list_of_options(model) -> None:
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) \['micro'\]; its options are: mode, "
    ):
        mpipe(model, micro=4)


def test_options_read_back_as_attributes_and_cannot_be_assigned(model) -> None:
    sched = mpipe(model, recompute=True, jit_options={"jit_level": "O1"})
    assert sched.recompute is True and sched.jit_options == {"jit_level": "O1"} and sched.mode == "graph"
    with pytest.raises(AttributeError):
        sched.recompute = False
    assert isinstance(sched.options, ScheduleOptions)


@pytest.mark.parametrize("schedule", [ge.ScheduleMPipeTranspose, ge.ScheduleInterleaved1F1B])
def test_help_documents_every_option_of_each_schedule(schedule) -> None:
    transposes = schedule is ge.ScheduleMPipeTranspose
    names = option_names(transposes)
    assert set(MPIPE_ONLY) <= set(names) if transposes else not set(MPIPE_ONLY) & set(names)
    keywords = [p.name for p in inspect.signature(schedule).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keywords == list(names)
    doc = inspect.getdoc(schedule)
    options_part = doc[doc.index("Options (keyword arguments") :]
    documented = [line.split(":")[0].strip() for line in options_part.splitlines()[1:] if line[:4] == "    "]
    assert [n for n in documented if n in names] == list(names)
    for field in dataclasses.fields(ScheduleOptions):
        if field.init:
            assert field.metadata["doc"] in " ".join(inspect.getdoc(ScheduleOptions).split())


@pytest.mark.parametrize(
    ("jit_options", "error"),
    [
        ("O1", r"jit_options must be a dict of mindspore.jit options or None, got str"),
        ({"jit_level": "O3"}, r"jit_options\['jit_level'\] must be one of 'O0', 'O1', got 'O3'"),
        ({"fullgraph": 1}, r"jit_options\['fullgraph'\] must be one of False, True, got 1"),
        ({"level": "O1"}, r"unknown option 'level'; allowed: 'jit_level', 'backend'"),
        ({"capture_mode": "trace"}, r"'capture_mode' cannot be set: .* stale gradients"),
        ({"dynamic": 1}, r"'dynamic' cannot be set: .* shapes='dynamic'"),
    ],
)
def test_bad_jit_options_name_the_bad_key_or_value(model, jit_options, error) -> None:
    with pytest.raises(ValueError, match=error):
        mpipe(model, jit_options=jit_options)


def test_every_accepted_jit_option_is_one_mindspore_jit_accepts() -> None:
    def double(x):
        return x * 2

    keywords = set(inspect.signature(ms.jit).parameters)
    for key, values in JIT_OPTIONS.items():
        for value in values:
            compiled = ms.jit(double, **{key: value})  # raises on a value 2.10 does not accept
            assert callable(compiled), (key, value)
        # a keyword of jit, or one of the back-end options jit checks by name
        assert key in keywords or key in ("exec_order", "disable_format_transform"), key


def run_recording_jit(monkeypatch, model, ref, **options) -> list[tuple[str, dict]]:
    """One training step (clipped, with a loss scaler, through ``step``) and one evaluation,
    every gradient kernel compiled (not the CPU host arithmetic); returns what every
    ``mindspore.jit`` call was given, and checks the step's numbers against the reference."""
    calls: list[tuple[str, dict]] = []
    real = ms.jit

    def recording(function=None, **kwargs):
        calls.append((getattr(function, "__name__", repr(function)), kwargs))
        return real(function, **kwargs)

    monkeypatch.setattr(ms, "jit", recording)
    compiled_gradients = dataclasses.replace(policy(), host_gradient_math=False)
    monkeypatch.setattr(kernel_executor, "policy", lambda: compiled_gradients)
    sched = mpipe(model, loss_scaler=amp.StaticLossScaler(4.0), **options)
    x, labels = batch(4)
    losses = sched.run(x, labels=labels)
    ref_losses, ref_grads = reference(ref, x, labels, 2)
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], ref_losses, atol=ATOL, rtol=RTOL)
    for name, grad in sched.grads().items():
        np.testing.assert_allclose(grad.asnumpy(), ref_grads[name], atol=ATOL, rtol=RTOL, err_msg=name)
    sched.step(nn.SGD(sched.trainable_params(), 0.1), max_norm=1e-3)
    sched.evaluate(x, labels=labels)
    return calls


#: A kernel of every kind the library compiles, by the name of the function it makes.
KINDS = (
    "adjust",  # the loss scaler's
    "preprocess_forward",
    "stage_forward",
    "value_and_gradient",  # the fused last stage
    "forward_and_gradient",  # the preprocess backward (recomputed)
    "stage_loss",  # forward only
    "check",  # unscale and check the gradients
    "part",  # the gradient norm
    "multiply_grads",  # clip
    "zero_grads",
)


def kinds(calls) -> set[str]:
    return {kind for name, _ in calls for kind in KINDS if name.startswith(kind)}


def test_jit_options_reach_every_kernel_the_library_compiles(monkeypatch) -> None:
    calls = run_recording_jit(
        monkeypatch, build(2, "trainable"), build(2, "trainable"), jit_options={"jit_level": "O1"}
    )
    assert kinds(calls) == set(KINDS)
    assert [name for name, kwargs in calls if kwargs != {"jit_level": "O1"}] == []


def test_without_jit_options_mindspore_jit_gets_its_defaults(monkeypatch) -> None:
    calls = run_recording_jit(monkeypatch, build(2, "trainable"), build(2, "trainable"))
    assert kinds(calls) == set(KINDS)
    assert [name for name, kwargs in calls if kwargs] == []
