"""Executor behaviour: mode selection, signature caching and compile counts, clear errors."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import ParameterTuple, Tensor, nn

from graph_exec.errors import GraphExecError
from graph_exec.executors import create_executor
from tests.models.common import loss_fn, named
from tests.models.kernel import MODES, WIDTH, Classifier, Combiner, Gate, Mixer, assert_grads_close, snapshot


def random(*shape: int, seed: int = 0, dtype: type = np.float32) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def test_unknown_mode_is_refused_with_the_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"'eager'.*graph, pynative"):
        create_executor("eager", {})


@pytest.mark.parametrize("mode", MODES)
def test_modes_report_their_name(mode: str) -> None:
    assert create_executor(mode, {}).mode == mode


def test_duplicate_trainable_parameter_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"duplicate trainable parameter name 'a\.weight'.*stage 0.*stage 1"):
        create_executor("pynative", {0: Combiner(), 1: Combiner()})


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_shared_by_two_stages_has_one_accumulator_holding_the_sum(mode: str) -> None:
    first, second = named(Combiner(), f"tied0_{mode}."), named(Combiner(), f"tied1_{mode}.")
    second.a.weight = first.a.weight
    executor = create_executor(mode, {0: first, 1: second})
    names = list(executor.grads())
    assert names.count(f"tied0_{mode}.a.weight") == 1
    assert len(names) == 3
    inputs = {
        stage: (random(2, WIDTH, seed=2 * stage), random(2, WIDTH, seed=2 * stage + 1)) for stage in (0, 1)
    }
    cotangents = {stage: random(2, WIDTH, seed=10 + stage) for stage in (0, 1)}
    for stage in (0, 1):
        executor.stage_forward(stage, 0, inputs[stage])
    for stage in (1, 0):
        executor.stage_backward(stage, 0, (cotangents[stage],))

    def objective() -> Tensor:
        return sum((cell(*inputs[s]) * cotangents[s]).sum() for s, cell in ((0, first), (1, second)))

    params = ParameterTuple([*first.trainable_params(), second.a.bias])
    _, weight_grads = ms.value_and_grad(objective, None, params)()
    want = {p.name: g.asnumpy() for p, g in zip(params, weight_grads, strict=True)}
    assert_grads_close(snapshot(executor.grads()), want)


def test_frozen_duplicates_are_allowed() -> None:
    first, second = Combiner(), Combiner()
    for param in second.trainable_params():
        param.requires_grad = False
    assert sorted(create_executor("pynative", {0: first, 1: second}).grads()) == ["a.bias", "a.weight"]


@pytest.mark.parametrize("recompute", [False, True])
def test_signature_cache_compiles_once_per_new_shape_and_cotangent_set(recompute: bool) -> None:
    executor = create_executor("graph", {0: named(Mixer(), f"sig{recompute}.")}, recompute=recompute)
    stats = executor.compile_stats

    def forward_backward(batch: int, micro: int, cotangents: str) -> None:
        inputs = (random(batch, WIDTH, seed=1), random(batch, WIDTH, seed=2))
        executor.stage_forward(0, micro, inputs)
        grads = {"both": (random(batch, WIDTH), random(batch, WIDTH)), "first": (random(batch, WIDTH), None)}
        executor.stage_backward(0, micro, grads[cotangents])

    forward_backward(2, 0, "both")
    assert stats.compilations == 2  # the forward and the backward
    compiled, seconds = stats.compilations, stats.compile_seconds
    assert seconds > 0
    forward_backward(2, 1, "both")
    assert (stats.compilations, stats.compile_seconds) == (compiled, seconds)  # repeat: no compile
    forward_backward(3, 2, "both")
    assert stats.compilations == compiled + 2  # new batch size: one forward, one backward
    forward_backward(3, 3, "first")
    assert stats.compilations == compiled + 3  # same inputs, one cotangent fewer: backward only
    forward_backward(2, 4, "first")
    assert stats.compilations == compiled + 4


def test_pynative_never_compiles() -> None:
    executor = create_executor("pynative", {0: named(Mixer(), "eager.")})
    executor.stage_forward(0, 0, (random(2, WIDTH), random(2, WIDTH)))
    executor.stage_backward(0, 0, (random(2, WIDTH), None))
    assert executor.compile_stats.compilations == 0
    assert executor.compile_stats.compile_seconds == 0


@pytest.fixture(params=MODES)
def mixer_executor(request: pytest.FixtureRequest):
    return create_executor(request.param, {0: named(Mixer(), f"err_{request.param}.")})


def forward(executor, micro: int = 0, batch: int = 2) -> tuple:
    return executor.stage_forward(0, micro, (random(batch, WIDTH), random(batch, WIDTH)))


def test_backward_without_forward(mixer_executor) -> None:
    with pytest.raises(RuntimeError, match=r"stage_backward\(stage 0, micro 5\) has no forward"):
        mixer_executor.stage_backward(0, 5, (None, None))


def test_backward_twice_for_one_forward(mixer_executor) -> None:
    forward(mixer_executor, micro=1)
    mixer_executor.stage_backward(0, 1, (random(2, WIDTH), None))
    with pytest.raises(RuntimeError, match=r"stage_backward\(stage 0, micro 1\) was already called"):
        mixer_executor.stage_backward(0, 1, (random(2, WIDTH), None))


def test_forward_twice_without_backward(mixer_executor) -> None:
    forward(mixer_executor, micro=2)
    with pytest.raises(RuntimeError, match=r"stage 0, micro 2.*already kept"):
        forward(mixer_executor, micro=2)


def test_cotangent_of_wrong_shape_is_refused_and_the_forward_stays_kept(mixer_executor) -> None:
    forward(mixer_executor, micro=3)
    with pytest.raises(
        ValueError, match=r"stage 0, micro 3: cotangent 1 is \[3, 6\] Float32, but output 1 is \[2, 6\]"
    ):
        mixer_executor.stage_backward(0, 3, (None, random(3, WIDTH)))
    assert list(mixer_executor.kept()) == [(0, 3)]
    mixer_executor.stage_backward(0, 3, (None, random(2, WIDTH)))
    assert list(mixer_executor.kept()) == []


def test_cotangent_of_wrong_dtype(mixer_executor) -> None:
    forward(mixer_executor)
    with pytest.raises(ValueError, match=r"stage 0, micro 0: cotangent 0 is \[2, 6\] Float16"):
        mixer_executor.stage_backward(0, 0, (random(2, WIDTH, dtype=np.float16), None))


def test_wrong_number_of_cotangents(mixer_executor) -> None:
    forward(mixer_executor)
    with pytest.raises(
        ValueError, match=r"stage 0, micro 0: expected 2 cotangent\(s\), one per output, got 1"
    ):
        mixer_executor.stage_backward(0, 0, (random(2, WIDTH),))


def test_cotangent_must_be_a_tensor(mixer_executor) -> None:
    forward(mixer_executor)
    with pytest.raises(TypeError, match="cotangent 0 must be a Tensor or None"):
        mixer_executor.stage_backward(0, 0, (np.zeros((2, WIDTH), np.float32), None))


def test_unknown_stage(mixer_executor) -> None:
    with pytest.raises(KeyError, match=r"stage 4 is not on this rank \(stages here: \[0\]\)"):
        mixer_executor.stage_forward(4, 0, (random(2, WIDTH),))


@pytest.mark.parametrize("mode", MODES)
def test_integer_output_takes_no_cotangent(mode: str) -> None:
    class PassIds(nn.Cell):
        def construct(self, h: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
            return h * 2, ids

    executor = create_executor(mode, {0: PassIds()})
    ids = Tensor(np.array([1, 2], np.int32))
    executor.stage_forward(0, 0, (random(2, WIDTH), ids))
    with pytest.raises(ValueError, match=r"output 1 is .* cannot take a gradient; pass None"):
        executor.stage_backward(0, 0, (None, ids))


@pytest.mark.parametrize("mode", MODES)
def test_last_stage_step_only_on_the_last_stage(mode: str) -> None:
    stages = {0: named(Gate(), f"g_{mode}."), 1: named(Classifier(), f"c_{mode}.")}
    executor = create_executor(mode, stages, loss_fn=loss_fn)
    labels = (Tensor(np.array([0, 1], np.int32)),)
    with pytest.raises(ValueError, match=r"last_stage_step\(stage 0, micro 0\): the last stage is 1"):
        executor.last_stage_step(0, 0, (random(2, WIDTH), Tensor(np.array([0, 1], np.int32))), labels)
    explicit = create_executor(mode, stages, loss_fn=loss_fn, last_stage=7)
    with pytest.raises(ValueError, match="the last stage is 7"):
        explicit.last_stage_step(1, 0, (random(2, WIDTH),), labels)


@pytest.mark.parametrize("mode", MODES)
def test_loss_from_the_stage_itself_when_no_loss_fn(mode: str) -> None:
    """Without ``loss_fn`` the last chunk gets the labels and returns the scalar loss."""

    class WithLoss(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = Classifier()

        def construct(self, h: Tensor, labels: Tensor) -> Tensor:
            return loss_fn(self.classifier(h), labels)

    ms.set_seed(9)
    cell = named(WithLoss(), f"wl_{mode}.")
    h, labels = random(2, WIDTH, seed=3), Tensor(np.array([2, 0], np.int32))
    executor = create_executor(mode, {0: cell}, loss_scale=0.5)
    loss, (d_h,) = executor.last_stage_step(0, 0, (h,), (labels,))
    weights = cell.trainable_params()
    want_loss, (want_dh, want_weights) = ms.value_and_grad(cell, (0,), weights)(h, labels)
    np.testing.assert_allclose(loss.asnumpy(), want_loss.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(d_h.asnumpy(), 0.5 * want_dh.asnumpy(), atol=1e-6, rtol=1e-5)
    assert_grads_close(
        snapshot(executor.grads()),
        {p.name: 0.5 * g.asnumpy() for p, g in zip(weights, want_weights, strict=True)},
    )

    not_scalar = create_executor(mode, {0: named(Classifier(), f"ns_{mode}.")})
    with pytest.raises(
        ValueError, match=r"stage 0, micro 0\): the loss must be a scalar, got shape \[2, 3\]"
    ):
        not_scalar.last_stage_step(0, 0, (h,), ())


def test_every_executor_error_is_a_graph_exec_error(mixer_executor) -> None:
    with pytest.raises(GraphExecError):
        mixer_executor.stage_backward(0, 9, (None, None))
    with pytest.raises(GraphExecError):
        mixer_executor.stage_forward(9, 0, ())
    forward(mixer_executor)
    with pytest.raises(GraphExecError):
        mixer_executor.stage_backward(0, 0, (None,))
    with pytest.raises(GraphExecError):
        mixer_executor.stage_backward(0, 0, ("not a tensor", None))
    with pytest.raises(GraphExecError):
        create_executor("eager", {})


@pytest.mark.parametrize("mode", MODES)
def test_bare_stage_forward_computes_what_the_hook_computes_and_keeps_nothing(mode: str) -> None:
    """The harness times the hook against this kernel: it must be the same computation."""
    executor = create_executor(mode, {0: named(Combiner(), f"bare_{mode}.")})
    inputs = (random(2, WIDTH, seed=3), random(2, WIDTH, seed=4))
    bare = executor.bare_stage_forward(0)
    direct = bare(*inputs)
    direct = direct if isinstance(direct, tuple) else (direct,)
    assert list(executor.kept()) == []
    hooked = executor.stage_forward(0, 0, inputs)
    assert len(hooked) == len(direct)
    for got, want in zip(direct, hooked, strict=True):
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    executor.drop_kept()
    with pytest.raises(GraphExecError, match="stage 7"):
        executor.bare_stage_forward(7)


@pytest.mark.parametrize("mode", MODES)
def test_a_full_kernel_cache_evicts_the_oldest_and_a_kept_forward_still_finishes(mode: str) -> None:
    cell = named(Mixer(), f"lru_{mode}.")
    executor = create_executor(mode, {0: cell}, kernel_cache_size=2)
    full = create_executor(mode, {0: named(Mixer(), f"lru_full_{mode}.")})
    for p, q in zip(cell.trainable_params(), full._stages[0].trainable_params(), strict=True):
        q.set_data(Tensor(p.asnumpy().copy()))
    kept = (random(2, WIDTH, seed=1), random(2, WIDTH, seed=2))
    executor.stage_forward(0, 0, kept)  # its tape may be evicted before its backward runs
    full.stage_forward(0, 0, kept)
    for micro, batch in enumerate((3, 4, 5), start=1):  # new shapes: forward and backward kernels
        inputs = (random(batch, WIDTH, seed=micro), random(batch, WIDTH, seed=micro + 10))
        cotangents = (random(batch, WIDTH, seed=micro + 20), None)
        for ex in (executor, full):
            ex.stage_forward(0, micro, inputs)
            ex.stage_backward(0, micro, cotangents)
    sens = (random(2, WIDTH, seed=30), random(2, WIDTH, seed=31))
    executor.stage_backward(0, 0, sens)
    full.stage_backward(0, 0, sens)
    stats = executor.compile_stats
    assert stats.cached_kernels == 2 and stats.evictions >= 4
    assert full.compile_stats.evictions == 0
    want = {k.replace("lru_full_", "lru_"): v for k, v in snapshot(full.grads()).items()}
    assert_grads_close(snapshot(executor.grads()), want)
    if mode == "graph":
        before = stats.compilations
        executor.stage_forward(0, 9, kept)  # a shape evicted long ago: made and compiled again
        assert executor.compile_stats.compilations == before + 1
        assert isinstance(stats.mindspore_compilations, int) and stats.mindspore_compilations > 0
        executor.drop_kept()
