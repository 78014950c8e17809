"""What a training loop needs, on one process (P = 1, every stage local, no communication):
the global gradient norm and clipping, loss scaling with MindSpore's scalers, ``step()``,
per-token loss, forward-only ``evaluate()``, tied parameters, low precision and their bad
inputs. The multi-rank versions are in ``tests/multirank/test_training_loop.py``.

Numbers are checked against the non-pipelined reference: float32 within atol 1e-5 / rtol 1e-4
(norms rtol 1e-5), float16 and bfloat16 within ``LOW_PRECISION_TOLERANCE``.
"""

from __future__ import annotations

import math
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, amp, nn, ops

import graph_exec as ge
from graph_exec.errors import (
    ConfigurationMismatchError,
    GraphExecError,
    NonFiniteGradientError,
    PipelineStepError,
    TiedCopiesDriftError,
)
from graph_exec.runtime.grad_norm import NonFiniteGradientWarning
from tests.models.common import ATOL, RTOL, loss_fn
from tests.models.pipeline import batch, build, reference, sgd_step
from tests.models.training import (
    LOW_PRECISION_TOLERANCE,
    build_gated,
    build_low_precision,
    build_tied,
    global_norm,
    padding_mask,
    tie,
    tied_batch,
    token_loss,
    token_reference,
)

MODES = ("graph", "pynative")
MICRO = 4


def schedule(model, mode="graph", micro=MICRO, **options):
    stages = [ge.PipelineStage(cell, k, len(model.stages)) for k, cell in enumerate(model.stages)]
    layers = 0 if model.preprocess is None else 1
    options.setdefault("loss_fn", loss_fn)
    return ge.ScheduleMPipeTranspose(stages, micro, model.preprocess, layers, mode=mode, **options)


def grads_of(sched) -> dict[str, np.ndarray]:
    return {name: g.asnumpy().copy() for name, g in sched.grads().items()}


def assert_grads(actual: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL, factor: float = 1.0):
    assert expected and set(actual) == set(expected)
    for name in expected:
        np.testing.assert_allclose(actual[name], factor * expected[name], atol=atol, rtol=rtol, err_msg=name)


def assert_losses(losses, expected, atol: float = ATOL, rtol: float = RTOL):
    np.testing.assert_allclose([float(x.asnumpy()) for x in losses], expected, atol=atol, rtol=rtol)


# -- the global norm -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pynative"])  # graph mode: tests/multirank/test_training_loop.py
@pytest.mark.parametrize("preprocess", ["trainable", "frozen"])
def test_clip_grad_norm_is_the_reference_norm_and_clips_like_it(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    sched = schedule(model, mode, scale_grads=True)
    x, labels = batch(8)
    sched.run(x, labels=labels)
    _, expected = reference(ref, x, labels, MICRO, scale=1 / MICRO)
    for norm_type in (2.0, 1.0, math.inf):
        norm = sched.clip_grad_norm(math.inf, norm_type=norm_type)  # inf: only measures
        assert norm == pytest.approx(global_norm(expected, norm_type), rel=1e-5), norm_type
    assert_grads(grads_of(sched), expected)
    reference_norm = global_norm(expected)
    assert sched.clip_grad_norm(2 * reference_norm) == pytest.approx(reference_norm, rel=1e-5)
    assert_grads(grads_of(sched), expected)  # below max_norm: unchanged
    max_norm = 0.25 * reference_norm
    assert sched.clip_grad_norm(max_norm) == pytest.approx(reference_norm, rel=1e-5)
    assert_grads(grads_of(sched), expected, factor=max_norm / (reference_norm + 1e-6))
    assert sched.clip_grad_norm(math.inf) == pytest.approx(max_norm, rel=1e-5)


# -- loss scaling and step() -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["graph"])  # the scale is a graph input: graph mode is the point
def test_dynamic_loss_scale_is_a_graph_input_and_grows_after_finite_steps(mode):
    """Window 1: the scale doubles after every finite step; the gradients are unscaled (equal
    to the reference's), nothing recompiles for a new scale, and step() applies the optimizer."""
    model, ref = build(3, "trainable"), build(3, "trainable")
    scaler = amp.DynamicLossScaler(2.0**8, 2, 1)
    sched = schedule(model, mode, scale_grads=True, loss_scaler=scaler)
    optimizer = nn.SGD(sched.trainable_params(), learning_rate=0.5)
    compilations = None
    for step in range(3):
        x, labels = batch(8, seed=40 + step)
        losses = sched.run(x, labels=labels)
        ref_losses, expected = reference(ref, x, labels, MICRO, scale=1 / MICRO)
        assert_losses(losses, ref_losses)
        assert_grads(grads_of(sched), expected)
        assert sched.grads_finite is True
        if compilations is not None:  # every kernel, zero_grad's included, ran in step 0
            assert sched.stats()["compilations"] == compilations, f"step {step} compiled again"
        outcome = sched.step(optimizer)
        compilations = sched.stats()["compilations"]
        assert outcome == {"finite": True, "grad_norm": None, "loss_scale": 2.0 ** (9 + step)}
        assert not any(g.asnumpy().any() for g in sched.grads().values()), "step() zeroes the gradients"
        sgd_step(ref.params(), expected, 0.5)


@pytest.mark.parametrize("mode", ["pynative"])  # graph mode: the dp2 x pp2 overflow check
def test_an_overflow_skips_the_step_lowers_the_scale_and_the_next_step_is_exact(mode):
    model, ref = build_gated(3, gated=1), build(3, "trainable")
    scaler = amp.DynamicLossScaler(2.0**10, 2, 1000)
    sched = schedule(model, mode, scale_grads=True, loss_scaler=scaler)
    optimizer = nn.Adam(sched.trainable_params(), learning_rate=0.1)
    before = {p.name: p.asnumpy().copy() for p in sched.trainable_params()}
    moments = [m.asnumpy().copy() for m in optimizer.moment1]
    model.stages[1].overflow(True)
    x, labels = batch(8, seed=50)
    sched.run(x, labels=labels)
    assert sched.grads_finite is False
    assert sched.step(optimizer, max_norm=1.0) == {"finite": False, "grad_norm": None, "loss_scale": 512.0}
    for param in sched.trainable_params():
        np.testing.assert_array_equal(param.asnumpy(), before[param.name], err_msg=f"{param.name} moved")
    for moment, was in zip(optimizer.moment1, moments, strict=True):
        np.testing.assert_array_equal(moment.asnumpy(), was)
    model.stages[1].overflow(False)
    x, labels = batch(8, seed=51)
    losses = sched.run(x, labels=labels)
    ref_losses, expected = reference(ref, x, labels, MICRO, scale=1 / MICRO)
    assert sched.grads_finite is True
    assert_losses(losses, ref_losses)
    assert_grads(grads_of(sched), expected)
    outcome = sched.step(optimizer, max_norm=1.0)
    assert outcome["finite"] is True and outcome["loss_scale"] == 512.0
    assert outcome["grad_norm"] == pytest.approx(global_norm(expected), rel=1e-5)


@pytest.mark.parametrize("mode", ["pynative"])
def test_accumulating_two_runs_unscales_each_with_its_own_scale(mode):
    """Without zero_grad the second run adds to the first, each unscaled by the scale it ran
    with (256, then 512: the window is 1), and a static scale of 1000 (not a power of two)."""
    for scaler, scales in (
        (amp.DynamicLossScaler(2.0**8, 2, 1), (512.0, 1024.0)),
        (amp.StaticLossScaler(1000), (1000.0, 1000.0)),
    ):
        model, ref = build(3, "trainable"), build(3, "trainable")
        sched = schedule(model, mode, loss_scaler=scaler)
        total = None
        for step, scale in enumerate(scales):
            x, labels = batch(8, seed=60 + step)
            sched.run(x, labels=labels)
            _, expected = reference(ref, x, labels, MICRO)
            total = expected if total is None else {k: total[k] + v for k, v in expected.items()}
            assert_grads(grads_of(sched), total)
            assert float(scaler.scale_value.asnumpy()) == scale


# -- per-token loss --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["graph"])  # pynative: tests/multirank/test_training_loop.py
def test_per_token_loss_is_the_gradient_of_all_token_losses_over_all_tokens(mode):
    model, ref = build(3, "trainable"), build(3, "trainable")
    sched = schedule(
        model, mode, loss_fn=token_loss, loss_reduction="token", loss_scaler=amp.StaticLossScaler(8)
    )
    x, labels = batch(8)
    mask = padding_mask(8, MICRO)
    counts = mask.asnumpy().reshape(MICRO, -1).sum(axis=1)
    assert len(set(counts)) > 1, "the micro-batches must hold different token counts"
    losses = sched.run(x, labels=(labels, mask))
    ref_losses, expected, _ = token_reference(ref, x, labels, mask, MICRO)
    assert_losses(losses, ref_losses)
    assert_grads(grads_of(sched), expected)
    # The mean of per-micro-batch means (what "mean" gives) is a different objective here.
    _, means = reference(ref, x, labels, MICRO, scale=1 / MICRO)
    assert any(not np.allclose(expected[k], means[k], atol=ATOL, rtol=RTOL) for k in expected)


# -- evaluate() ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pynative"])  # graph mode: tests/multirank/test_training_loop.py
@pytest.mark.parametrize("preprocess", ["trainable", "none"])
def test_evaluate_is_the_reference_forward_and_touches_no_gradient(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    sched = schedule(model, mode, scale_grads=True)
    optimizer = nn.Adam(sched.trainable_params(), learning_rate=0.1)
    x, labels = batch(8, seed=70)
    sched.run(x, labels=labels)
    held = grads_of(sched)
    moments = [m.asnumpy().copy() for m in optimizer.moment1]
    eval_x, eval_labels = batch(8, seed=71)
    ref_losses, _ = reference(ref, eval_x, eval_labels, MICRO)
    assert_losses(sched.evaluate(eval_x, labels=eval_labels), ref_losses)
    outputs = sched.evaluate(eval_x)
    rows = 8 // MICRO
    for m, output in enumerate(outputs):
        h = eval_x[m * rows : (m + 1) * rows]
        h = ref.preprocess(h) if ref.preprocess is not None else h
        for stage in ref.stages:
            h = stage(*h) if isinstance(h, tuple) else stage(h)
        np.testing.assert_allclose(output.asnumpy(), h.asnumpy(), atol=ATOL, rtol=RTOL)
    assert_grads(grads_of(sched), held, atol=0, rtol=0)  # untouched, bit for bit
    for moment, was in zip(optimizer.moment1, moments, strict=True):
        np.testing.assert_array_equal(moment.asnumpy(), was)
    assert not sched._setup.executor.kept()
    assert sched.step(optimizer)["finite"] is True  # no scaler: checked all the same (issue 39.2)


# -- tied parameters -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pynative"])  # graph mode: tests/multirank/test_training_loop.py
def test_tied_embedding_and_head_train_as_one_weight(mode):
    (model, pair), (ref, _) = build_tied(3), build_tied(3)
    sched = schedule(model, mode, scale_grads=True, tied_parameters=[pair])
    optimizer = nn.SGD(sched.trainable_params(), learning_rate=0.5)
    for step in range(2):
        x, labels = tied_batch(8, seed=80 + step)
        losses = sched.run(x, labels=labels)
        ref_losses, grads = reference(ref, x, labels, MICRO, scale=1 / MICRO)
        expected = tie(grads, pair)
        assert_losses(losses, ref_losses)
        assert_grads(grads_of(sched), expected)
        norm = global_norm(expected, skip=(pair[1],))
        outcome = sched.step(optimizer, max_norm=math.inf)
        assert outcome["grad_norm"] == pytest.approx(norm, rel=1e-5)
        sgd_step(ref.params(), expected, 0.5)
        a, b = (p for p in sched.trainable_params() if p.name in pair)
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_tied_parameters_that_differ_at_the_first_step_are_refused():
    model, pair = build_tied(2)
    ops.assign(model.stages[-1].out.weight, model.stages[-1].out.weight + 1)
    sched = schedule(model, tied_parameters=[pair])
    x, labels = tied_batch(4)
    with pytest.raises(ConfigurationMismatchError, match="different values"):
        sched.run(x, labels=labels)


def test_tied_copies_that_an_optimizer_moves_apart_fail_the_next_step_naming_the_pair(cpu_path):
    """Weight decay on every parameter but the embedding (a common per-group choice) moves the
    head's copy away from the embedding: the next run() raises on the checksums that rode with
    the tied gradients, naming the pair; with one setting for both, steps go on."""
    model, pair = build_tied(2)
    sched = schedule(model, tied_parameters=[pair])
    params = sched.trainable_params()
    same = nn.SGD(params, learning_rate=0.5, weight_decay=0.1)
    for step in range(2):
        x, labels = tied_batch(4, seed=90 + step)
        sched.run(x, labels=labels)
        sched.step(same)
    embedding = [p for p in params if p.name == pair[0]]
    decayed = [p for p in params if p.name != pair[0]]
    split = nn.SGD(
        [{"params": embedding, "weight_decay": 0.0}, {"params": decayed, "weight_decay": 0.1}],
        learning_rate=0.5,
    )
    x, labels = tied_batch(4, seed=92)
    sched.run(x, labels=labels)
    sched.step(split)
    x, labels = tied_batch(4, seed=93)
    with pytest.raises(
        TiedCopiesDriftError, match=rf"{pair[0]!r} and {pair[1]!r} no longer hold the same values"
    ):
        sched.run(x, labels=labels)


# -- low precision ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "how", "mode"),
    [
        (ms.float16, "to_float", "graph"),
        (ms.float16, "to_float", "pynative"),
        (ms.float16, "O1", "pynative"),
        (ms.float16, "O2", "graph"),
        (ms.float16, "O3", "pynative"),
        (ms.bfloat16, "bf16", "graph"),
        (ms.bfloat16, "bf16", "pynative"),
    ],
)
def test_low_precision_chunks_match_the_same_cast_model(dtype, how, mode, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # auto_mixed_precision O1 writes its rewritten cells here
    model, ref = build_low_precision(3, dtype, how), build_low_precision(3, dtype, how)
    sched = schedule(model, mode, loss_scaler=amp.DynamicLossScaler(2.0**4, 2, 1000))
    x, labels = batch(8)
    losses = sched.run(x, labels=labels)
    ref_losses, expected = reference(ref, x, labels, MICRO)
    atol, rtol = LOW_PRECISION_TOLERANCE[dtype]
    assert sched.grads_finite is True
    assert_losses(losses, ref_losses, atol, rtol)
    assert_grads(grads_of(sched), expected, atol, rtol)
    low = [p for p in sched.trainable_params() if p.dtype == dtype]
    assert low or how.startswith("O"), "the cast model has low-precision parameters"
    assert {str(g.dtype) for g in sched.grads().values()} == {"Float32"}
    if dtype == ms.float16:  # MindSpore's Adam takes float16 weights with float16 gradients only
        before = {p.name: p.asnumpy().copy() for p in sched.trainable_params()}
        assert sched.step(nn.Adam(sched.trainable_params(), learning_rate=0.01))["finite"] is True
        for param in sched.trainable_params():
            assert param.dtype == (dtype if how == "to_float" else ms.float32)
            assert not np.array_equal(param.asnumpy(), before[param.name]), f"{param.name} did not move"


# -- bad input -------------------------------------------------------------------------------


def test_a_scalar_loss_with_token_reduction_is_a_clear_error():
    sched = schedule(build(2, "none"), loss_reduction="token")
    x, labels = batch(8)
    with pytest.raises(
        PipelineStepError,
        match=r"loss_reduction='token' needs .* \(sum_of_token_losses, token_count\), got one tensor",
    ):
        sched.run(x, labels=labels)


def test_a_pair_with_token_reduction_off_names_the_option():
    sched = schedule(build(2, "none"), loss_fn=token_loss)
    x, labels = batch(8)
    with pytest.raises(GraphExecError, match="needs loss_reduction='token'"):
        sched.run(x, labels=(labels, padding_mask(8, MICRO)))


@pytest.mark.parametrize(
    ("tied", "error", "pattern"),
    [
        (
            [("pre.table.embedding_table", "s1.missing")],
            ValueError,
            r"'s1.missing' of the pair .* is not a parameter",
        ),
        (
            [("pre.table.embedding_table", "pre.table.embedding_table")],
            ValueError,
            "names one parameter twice",
        ),
        ("pre.table.embedding_table", TypeError, "list of \\(name, name\\) pairs"),
        ([("a",)], TypeError, "pair of two parameter names"),
        ([("s0.a.weight", "s1.out.weight")], ValueError, "one shape and dtype"),
    ],
)
def test_bad_tied_parameters_are_refused_at_construction(tied, error, pattern):
    model, _ = build_tied(2)
    with pytest.raises(error, match=pattern):
        schedule(model, tied_parameters=tied)


@pytest.mark.parametrize(
    ("scaler", "pattern"),
    [
        (2.0**16, "got float"),
        (
            amp.DynamicLossScaleManager(),
            "got the manager DynamicLossScaleManager .* mindspore.amp.DynamicLossScaler",
        ),
        (amp.FixedLossScaleManager(), "mindspore.amp.StaticLossScaler"),
    ],
)
def test_a_loss_scaler_of_the_wrong_type_is_refused(scaler, pattern):
    with pytest.raises(TypeError, match=pattern):
        schedule(build(2, "none"), loss_scaler=scaler)


def test_gradient_methods_before_the_first_run_are_clear_errors():
    sched = schedule(build(2, "none"), loss_scaler=amp.StaticLossScaler(1))
    optimizer = nn.SGD(sched.trainable_params())
    for call in (
        lambda: sched.clip_grad_norm(1.0),
        lambda: sched.grads_finite,
        lambda: sched.step(optimizer),
    ):
        with pytest.raises(GraphExecError, match=r"call run\(\) first"):
            call()
    x, labels = batch(8)
    sched.evaluate(x, labels=labels)  # sets up, but runs no training step
    with pytest.raises(GraphExecError, match=r"call run\(\) first"):
        sched.clip_grad_norm(1.0)


def test_other_bad_arguments_of_the_training_loop():
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        schedule(build(2, "none"), loss_reduction="sum")
    with pytest.raises(ValueError, match="scale_grads=True divides by the micro-batch count"):
        schedule(build(2, "none"), loss_reduction="token", scale_grads=True)
    sched = schedule(build(2, "none"), "pynative")
    x, labels = batch(8)
    sched.run(x, labels=labels)
    with pytest.raises(GraphExecError, match="grads_finite needs a loss_scaler"):
        _ = sched.grads_finite
    for bad in (0, -1.0, "1", True, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            sched.clip_grad_norm(bad)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        sched.clip_grad_norm(1.0, norm_type=0)
    with pytest.raises(TypeError, match="optimizer must be a MindSpore optimizer"):
        sched.step(lambda grads: None)
    other = nn.SGD([ms.Parameter(Tensor(np.ones(2, np.float32)), name="elsewhere")])
    with pytest.raises(
        ValueError, match=r"the optimizer updates \['elsewhere'\], which this rank does not train"
    ):
        sched.step(other)


# -- non-finite gradients without a loss scaler (issue 39.2) ---------------------------------


def _overflowing(mode: str = "pynative"):
    """A schedule whose stage 1 makes the next step's gradients infinite, no loss scaler; its
    optimizer, and the weights before anything was applied."""
    model = build_gated(3, gated=1)
    sched = schedule(model, mode, scale_grads=True)
    optimizer = nn.SGD(sched.trainable_params(), learning_rate=0.5)
    before = {p.name: p.asnumpy().copy() for p in sched.trainable_params()}
    model.stages[1].overflow(True)
    return model, sched, optimizer, before


def _weights_unchanged(sched, before: dict) -> None:
    for param in sched.trainable_params():
        np.testing.assert_array_equal(param.asnumpy(), before[param.name], err_msg=f"{param.name} moved")


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_non_finite_step_without_a_scaler_is_skipped_and_warned_about_each_time(max_norm):
    model, sched, optimizer, before = _overflowing()
    for step in range(2):  # warned again the second time: the message counts the refusals
        x, labels = batch(8, seed=50 + step)
        sched.run(x, labels=labels)
        with pytest.warns(NonFiniteGradientWarning) as caught:
            outcome = sched.step(optimizer, max_norm=max_norm)
        assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line
        assert f"the optimizer was not applied on any rank (non-finite step {step + 1} " in str(
            caught[0].message
        )
        assert outcome == {"finite": False, "grad_norm": None, "loss_scale": None}
        _weights_unchanged(sched, before)
        assert not any(g.asnumpy().any() for g in sched.grads().values()), "step() zeroes the gradients"
    model.stages[1].overflow(False)  # the next step is finite, applied, exact
    ref = build(3, "trainable")
    x, labels = batch(8, seed=52)
    sched.run(x, labels=labels)
    _, expected = reference(ref, x, labels, MICRO, scale=1 / MICRO)
    assert_grads(grads_of(sched), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outcome = sched.step(optimizer, max_norm=max_norm)
    assert outcome["finite"] is True
    assert (outcome["grad_norm"] is None) == (max_norm is None)


def test_error_if_nonfinite_raises_and_leaves_the_gradients_alone():
    model, sched, optimizer, before = _overflowing()
    x, labels = batch(8, seed=50)
    sched.run(x, labels=labels)
    held = grads_of(sched)
    assert not all(np.isfinite(g).all() for g in held.values())
    with pytest.raises(NonFiniteGradientError, match=r"step\(\): the global gradient norm is (nan|inf)"):
        sched.step(optimizer, max_norm=1.0, error_if_nonfinite=True)
    with pytest.raises(NonFiniteGradientError, match=r"step\(\): a gradient is not finite"):
        sched.step(optimizer, error_if_nonfinite=True)
    with pytest.raises(NonFiniteGradientError, match=r"clip_grad_norm\(\): the global gradient norm is"):
        sched.clip_grad_norm(1.0, error_if_nonfinite=True)
    assert_grads(grads_of(sched), held, atol=0, rtol=0)  # bit for bit (NaN equal to NaN)
    _weights_unchanged(sched, before)
    with pytest.raises(ValueError, match="error_if_nonfinite must be a bool"):
        sched.step(optimizer, error_if_nonfinite="yes")
    sched.zero_grad()  # still usable: every rank raised alike
    model.stages[1].overflow(False)
    sched.run(x, labels=labels)
    assert sched.step(optimizer, max_norm=1.0, error_if_nonfinite=True)["finite"] is True


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_of_a_non_finite_gradient_warns_and_scales_nothing(mode):
    _, sched, _, _ = _overflowing(mode)
    x, labels = batch(8, seed=50)
    sched.run(x, labels=labels)
    held = grads_of(sched)
    with pytest.warns(
        NonFiniteGradientWarning, match=r"clip_grad_norm\(\): .* nothing was scaled on any rank"
    ):
        norm = sched.clip_grad_norm(1.0)
    assert not math.isfinite(norm)
    assert_grads(grads_of(sched), held, atol=0, rtol=0)


def test_a_bad_optimizer_leaves_the_schedule_usable():
    model, ref = build(3, "trainable"), build(3, "trainable")
    sched = schedule(model, "pynative", scale_grads=True)
    x, labels = batch(8, seed=53)
    sched.run(x, labels=labels)
    stranger = nn.SGD(nn.Dense(2, 2).trainable_params(), learning_rate=0.5)
    with pytest.raises(ValueError, match="which this rank does not train"):
        sched.step(stranger)
    _, expected = reference(ref, x, labels, MICRO, scale=1 / MICRO)
    assert_grads(grads_of(sched), expected)  # nothing applied, nothing zeroed
    assert sched.step(nn.SGD(sched.trainable_params(), learning_rate=0.5))["finite"] is True


# -- exact facts (issue 38.4) ----------------------------------------------------------------


def test_a_global_token_count_above_2_to_the_24_is_exact(monkeypatch):
    big = 2**23  # each micro-batch's count exact in float32, their sum not

    def counted(logits, labels, mask):
        total, count = token_loss(logits, labels, mask)
        return total, count + big

    sched = schedule(build(3, "trainable"), "pynative", loss_fn=counted, loss_reduction="token")
    x, labels = batch(8, seed=30)
    mask = padding_mask(8, MICRO, seed=30)
    tokens = int(mask.asnumpy().sum()) + MICRO * big
    assert tokens > 2**24 and float(np.float32(tokens)) != tokens
    sched.run(x, labels=(labels, mask))
    sched.zero_grad()
    factors = []
    scale = sched._setup.executor.multiply_grads
    monkeypatch.setattr(sched._setup.executor, "multiply_grads", lambda f: (factors.append(f), scale(f))[1])
    sched.run(x, labels=(labels, mask))
    assert factors == [1 / tokens]  # D / N with N exact (float32 rounded it by 1 or 2)


def test_the_norm_keeps_the_float64_of_the_host():
    from graph_exec.device import policy

    if not policy().host_gradient_math:
        pytest.skip("the host gradient arithmetic is off: the compiled kernel adds in float32")
    sched = schedule(build(3, "trainable"), "graph", scale_grads=True)
    x, labels = batch(8, seed=54)
    sched.run(x, labels=labels)
    grads = [g.asnumpy().astype(np.float64) for g in sched.grads().values()]
    want = math.sqrt(math.fsum(float((g * g).sum()) for g in grads))
    norm = sched.clip_grad_norm(math.inf)
    assert abs(norm - want) <= 1e-12 * want, (norm, want)  # a float32 share is off by ~1e-8
