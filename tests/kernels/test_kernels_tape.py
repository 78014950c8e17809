"""The taped execution: micro-batches in flight, aborts, memory, the taped preprocess hooks.

Expected values come from ``mindspore.value_and_grad`` on the bare cells, one micro-batch at a
time, without any executor; tolerance ``|actual - expected| <= 1e-5 + 1e-4 * |expected|``.
Every numeric test runs in both modes, with the taped forward and with ``recompute=True``.
"""

from __future__ import annotations

import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import ParameterTuple, Tensor, nn

import graph_exec as ge
from graph_exec.benchmarks.executor_speed import measure_in_fresh_process
from graph_exec.executors import create_executor
from graph_exec.executors.tape import NOT_A_TUPLE, Tape
from graph_exec.kernels import make_stage_forward, make_stage_loss
from tests.models.common import assert_close, loss_fn, named
from tests.models.kernel import FEATURES, MODES, WIDTH, Classifier, Combiner, Mixer, Projector, snapshot

VARIANTS = [(mode, recompute) for mode in MODES for recompute in (False, True)]
IN_FLIGHT = 4
BACKWARD_ORDER = (2, 0, 3, 1)


def random(*shape: int, seed: int) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def vjp(fn, inputs: tuple, cotangents: tuple, weights: list) -> tuple[tuple, dict[str, np.ndarray]]:
    """Input gradients (all inputs) and weight gradients of ``sum_i <fn(*inputs)_i, c_i>``."""

    def objective(*args: Tensor) -> Tensor:
        outputs = fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((o * c).sum() for o, c in zip(outputs, cotangents, strict=True) if c is not None)

    params = ParameterTuple(weights)
    _, (input_grads, weight_grads) = ms.value_and_grad(objective, tuple(range(len(inputs))), params)(*inputs)
    input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
    return input_grads, {p.name: g.asnumpy() for p, g in zip(params, weight_grads, strict=True)}


@pytest.mark.parametrize(("mode", "recompute"), VARIANTS)
def test_micro_batches_in_flight_with_backwards_out_of_order(mode: str, recompute: bool) -> None:
    """Two chained stages, four forwards kept on each, backwards in another order."""
    ms.set_seed(21)
    first, second = named(Mixer(), f"fl0_{mode}{recompute}."), named(Combiner(), f"fl1_{mode}{recompute}.")
    executor = create_executor(mode, {0: first, 1: second}, recompute=recompute)
    inputs = [(random(3, WIDTH, seed=2 * m), random(3, WIDTH, seed=2 * m + 1)) for m in range(IN_FLIGHT)]
    cotangents = [random(3, WIDTH, seed=100 + m) for m in range(IN_FLIGHT)]
    for m in range(IN_FLIGHT):
        executor.stage_forward(1, m, executor.stage_forward(0, m, inputs[m]))
    assert sorted(executor.kept()) == sorted((s, m) for s in (0, 1) for m in range(IN_FLIGHT))

    want_weights = {name: 0.0 for name in snapshot(executor.grads())}
    for m in BACKWARD_ORDER:
        got = executor.stage_backward(0, m, executor.stage_backward(1, m, (cotangents[m],)))

        def chain(h: Tensor, g: Tensor) -> Tensor:
            return second(*first(h, g))

        want_inputs, weights = vjp(
            chain, inputs[m], (cotangents[m],), first.trainable_params() + second.trainable_params()
        )
        for index, (g, w) in enumerate(zip(got, want_inputs, strict=True)):
            assert_close(g, w, f"micro {m}, input gradient {index}")
        for name, grad in weights.items():
            want_weights[name] = want_weights[name] + grad
    assert list(executor.kept()) == []
    for name, grad in snapshot(executor.grads()).items():
        assert np.abs(want_weights[name]).max() > 0
        assert_close(grad, want_weights[name], f"accumulated gradient of {name}")


@pytest.mark.parametrize("mode", MODES)
def test_recompute_in_one_go_gives_the_recorded_backward_bit_for_bit(mode: str) -> None:
    """``Tape.recompute`` (forward and gradient in one call, one compiled graph in graph mode)
    against recording the forward and running its bprop, on one tape: same input and weight
    gradients exactly, for several upstream gradients in turn (each call must use its own),
    while a recorded forward of the same tape is in flight; that forward's backward is still
    exact afterwards."""
    ms.set_seed(23)
    cell = named(Mixer(), f"onego_{mode}.")
    prepare = ms.jit if mode == "graph" else (lambda kernel: kernel)
    tape = Tape(make_stage_forward(cell), ParameterTuple(cell.trainable_params()), True, prepare)
    in_flight = (random(3, WIDTH, seed=1), random(3, WIDTH, seed=2))
    in_flight_sens = (random(3, WIDTH, seed=3), random(3, WIDTH, seed=4))
    tape(*in_flight)

    def exact(got: tuple, want: tuple, what: str) -> None:
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(g.asnumpy(), w.asnumpy()), f"{what} {index} differs"

    for seed in range(3):
        args = (random(3, WIDTH, seed=10 + seed), random(3, WIDTH, seed=20 + seed))
        sens = (random(3, WIDTH, seed=30 + seed), random(3, WIDTH, seed=40 + seed))
        one_go = tape.recompute(args, sens)
        tape(*args)
        recorded = tape.backward(args, sens)
        exact(one_go[0], recorded[0], f"call {seed}: input gradient")
        exact(one_go[1], recorded[1], f"call {seed}: weight gradient")
    want_inputs, want_weights = vjp(cell, in_flight, in_flight_sens, cell.trainable_params())
    got_inputs, got_weights = tape.backward(in_flight, in_flight_sens)
    for index, (g, w) in enumerate(zip(got_inputs, want_inputs, strict=True)):
        assert_close(g, w, f"in-flight forward: input gradient {index}")
    for param, grad in zip(cell.trainable_params(), got_weights, strict=True):
        assert_close(grad, want_weights[param.name], f"in-flight forward: gradient of {param.name}")


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_in_one_go_give_the_recorded_backward_bit_for_bit(mode: str) -> None:
    """``Tape.value_and_gradient`` (the last stage's loss and gradients in one call) against the
    recorded loss forward and its bprop with the loss scale as upstream gradient: the same loss
    and the same input and weight gradients, exactly."""
    ms.set_seed(24)
    cell = named(Classifier(), f"loss_onego_{mode}.")
    prepare = ms.jit if mode == "graph" else (lambda kernel: kernel)
    tape = Tape(make_stage_loss(cell, 1, loss_fn), ParameterTuple(cell.trainable_params()), True, prepare)
    for seed, scale in enumerate((0.25, 1024.0)):  # the scale is a graph input: any value, no recompile
        args = (random(4, WIDTH, seed=50 + seed), Tensor(np.array([0, 2, 1, seed], np.int32)))
        loss, (input_grads, weight_grads) = tape.value_and_gradient(args, Tensor(scale, ms.float32))
        recorded_loss = tape(*args)
        want_inputs, want_weights = tape.backward(args, ms.ops.full((), scale, dtype=ms.float32))
        assert np.array_equal(loss.asnumpy(), recorded_loss.asnumpy()), f"call {seed}: loss differs"
        assert np.array_equal(input_grads[0].asnumpy(), want_inputs[0].asnumpy()), (
            f"call {seed}: input gradient"
        )
        for got, want in zip(weight_grads, want_weights, strict=True):
            assert np.array_equal(got.asnumpy(), want.asnumpy()), f"call {seed}: a weight gradient differs"
        assert np.abs(weight_grads[0].asnumpy()).max() > 0


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_of_one_element_of_a_tuple_output(mode: str) -> None:
    """``differentiated_output=0``: a kernel returning ``(sum, count)`` (a per-token loss) is
    differentiated through its sum only, and returns both; a kernel returning one tensor
    instead is refused with :data:`NOT_A_TUPLE` (raised inside the graph in graph mode)."""
    ms.set_seed(25)
    cell = named(Classifier(), f"loss_pair_{mode}.")
    prepare = ms.jit if mode == "graph" else (lambda kernel: kernel)

    def summed(logits, labels):
        return ms.ops.cross_entropy(logits, labels, reduction="sum"), (labels >= 0).sum()

    weights = ParameterTuple(cell.trainable_params())
    tape = Tape(make_stage_loss(cell, 1, summed), weights, True, prepare, differentiated_output=0)
    args = (random(4, WIDTH, seed=60), Tensor(np.array([0, 2, 1, 1], np.int32)))
    (total, count), (input_grads, weight_grads) = tape.value_and_gradient(args, Tensor(0.5, ms.float32))
    want_total, (want_inputs, want_weights) = ms.value_and_grad(
        lambda h, y: summed(cell(h), y)[0], (0,), weights
    )(*args)
    assert int(count.asnumpy()) == 4
    assert_close(total, want_total, "the sum")
    assert_close(input_grads[0], 0.5 * want_inputs.asnumpy(), "input gradient")
    for param, got, want in zip(weights, weight_grads, want_weights, strict=True):
        assert_close(got, 0.5 * want.asnumpy(), f"gradient of {param.name}")
    scalar = Tape(make_stage_loss(cell, 1, loss_fn), weights, True, prepare, differentiated_output=0)
    with pytest.raises(ValueError, match=re.escape(NOT_A_TUPLE)):
        scalar.value_and_gradient(args, Tensor(1.0, ms.float32))


@pytest.mark.parametrize("mode", MODES)
def test_integer_output_with_a_missing_cotangent_is_fine(mode: str) -> None:
    """A tuple output with an integer part: its cotangent is None and counts as zero."""

    class PassIds(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Dense(WIDTH, WIDTH)

        def construct(self, h: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
            return self.a(h), ids + 1

    cell = named(PassIds(), f"ids_{mode}.")
    executor = create_executor(mode, {0: cell})
    h, ids, c = random(2, WIDTH, seed=1), Tensor(np.array([1, 2], np.int32)), random(2, WIDTH, seed=2)
    executor.stage_forward(0, 0, (h, ids))
    d_h, d_ids = executor.stage_backward(0, 0, (c, None))
    assert d_ids is None
    want_inputs, want_weights = vjp(lambda x: cell(x, ids)[0], (h,), (c,), cell.trainable_params())
    assert_close(d_h, want_inputs[0], "input gradient")
    for name, grad in snapshot(executor.grads()).items():
        assert_close(grad, want_weights[name], f"gradient of {name}")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("mode", MODES)
def test_an_aborted_step_leaves_no_tape_state(mode: str) -> None:
    """Forwards kept, then dropped as the runtime's abort path does, round after round.

    Each round holds about 8 in flight x 8 layers x 2 tensors x 256 KiB = 32 MiB of taped
    activations; were dropped tapes not freed, five rounds would add 160 MiB. The resident set
    may grow by less than one round's worth (allocator slack), and the executor works on.
    """
    ms.set_seed(22)
    layers = [nn.SequentialCell([nn.Dense(256, 256), nn.Tanh()]) for _ in range(8)]
    cell = named(nn.SequentialCell(layers), f"abort_{mode}.")
    executor = create_executor(mode, {0: cell})
    rows = [random(256, 256, seed=m) for m in range(8)]

    def aborted_round() -> None:
        for m, x in enumerate(rows):
            executor.stage_forward(0, m, (x,))[0].asnumpy()
        executor.drop_kept()

    aborted_round()  # warm-up: compiles, sizes the allocator
    before = _resident_bytes()
    for _ in range(5):
        aborted_round()
    grown = _resident_bytes() - before
    assert list(executor.kept()) == []
    assert grown < 32 * 2**20, f"resident set grew by {grown / 2**20:.0f} MiB over 5 aborted rounds"
    with pytest.raises(RuntimeError, match=r"stage_backward\(stage 0, micro 3\) has no forward"):
        executor.stage_backward(0, 3, (random(256, 256, seed=9),))

    x, c = rows[0], random(256, 256, seed=10)
    (d_x,) = executor.stage_forward(0, 0, (x,)) and executor.stage_backward(0, 0, (c,))
    want_inputs, want_weights = vjp(cell, (x,), (c,), cell.trainable_params())
    assert_close(d_x, want_inputs[0], "input gradient after the aborts")
    for name, grad in snapshot(executor.grads()).items():
        assert_close(grad, want_weights[name], f"gradient of {name} after the aborts")


def test_memory_held_per_in_flight_micro_batch_tape_against_recompute() -> None:
    """The example LM stage (3 blocks, width 64, batch 2x32; its input is 16 KiB), each variant
    measured in a fresh process: the tape holds the activations (about 1.2 MiB measured), the
    recompute path only the input, which the caller already holds."""
    input_bytes = 2 * 32 * 64 * 4
    tape = measure_in_fresh_process("--memory-probe", "graph", "False", "16")
    recompute = measure_in_fresh_process("--memory-probe", "graph", "True", "16")
    assert recompute <= 2 * input_bytes, f"recompute holds {recompute / 1024:.0f} KiB per micro-batch"
    assert tape >= 20 * input_bytes, f"the tape holds only {tape / 1024:.0f} KiB per micro-batch"


def test_recompute_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"recompute must be a bool \(True or False\), got 'yes'"):
        create_executor("graph", {}, recompute="yes")
    stage = ge.PipelineStage(named(Classifier(), "rb."), 0, 1)
    for schedule in (ge.ScheduleMPipeTranspose, ge.ScheduleInterleaved1F1B):
        with pytest.raises(ValueError, match=r"recompute must be a bool \(True or False\), got 1"):
            schedule(stage, 2, recompute=1)


@pytest.mark.parametrize(("mode", "recompute"), VARIANTS)
def test_taped_preprocess_hooks_match_the_reference(mode: str, recompute: bool) -> None:
    """Preprocess forward kept under a key, body and loss, backwards out of order; micro 1's
    second preprocess output gets no cotangent (counts as zero)."""
    ms.set_seed(23)
    tag = f"{mode}{recompute}"
    pre, body, head = (
        named(Projector(), f"tp_pre_{tag}."),
        named(Combiner(), f"tp0_{tag}."),
        named(Classifier(), f"tp1_{tag}."),
    )
    executor = create_executor(mode, {0: body, 1: head}, preprocess=pre, loss_fn=loss_fn)
    xs = [random(3, FEATURES, seed=30 + m) for m in range(3)]
    labels = [Tensor(np.array([0, 2, 1], np.int32)) for _ in range(3)]
    d_hidden = {}
    for m in range(3):
        hidden = executor.preprocess_forward_taped(("micro", m), (xs[m],), {})
        _, (d_mixed,) = executor.last_stage_step(1, m, executor.stage_forward(0, m, hidden), (labels[m],))
        d_hidden[m] = (d_mixed, hidden)
    assert ("micro", 1) in executor.kept()
    pre_grads = {name: 0.0 for name in (p.name for p in pre.trainable_params())}
    for m in (2, 0, 1):
        grads = executor.stage_backward(0, m, (d_hidden[m][0],))
        if m == 1:
            grads = (grads[0], None)
        executor.preprocess_backward_taped(("micro", m), grads)
        cotangents = tuple(None if g is None else g for g in grads)
        _, weights = vjp(pre, (xs[m],), cotangents, pre.trainable_params())
        for name in pre_grads:
            pre_grads[name] = pre_grads[name] + weights[name]
    assert list(executor.kept()) == []
    got = snapshot(executor.grads())
    for name, want in pre_grads.items():
        assert np.abs(want).max() > 0
        assert_close(got[name], want, f"preprocess gradient of {name}")

    def whole(x: Tensor, y: Tensor) -> Tensor:
        return loss_fn(head(body(*pre(x))), y)

    body_params = body.trainable_params() + head.trainable_params()
    step = ms.value_and_grad(whole, None, ParameterTuple(body_params))
    want_body = {p.name: 0.0 for p in body_params}
    for x, y in zip(xs, labels, strict=True):
        _, grads = step(x, y)
        for param, grad in zip(body_params, grads, strict=True):
            want_body[param.name] = want_body[param.name] + grad.asnumpy()
    for name, want in want_body.items():
        assert_close(got[name], want, f"body gradient of {name}")


@pytest.mark.parametrize("mode", MODES)
def test_taped_preprocess_bad_calls_raise_before_any_compute(mode: str) -> None:
    executor = create_executor(mode, {}, preprocess=named(Projector(), f"tpbad_{mode}."))
    x = random(2, FEATURES, seed=40)
    with pytest.raises(RuntimeError, match=r"preprocess_backward_taped\(key 7\) has no forward"):
        executor.preprocess_backward_taped(7, (None, None))
    executor.preprocess_forward_taped(7, (x,), {})
    with pytest.raises(RuntimeError, match=r"key 7.*already kept"):
        executor.preprocess_forward_taped(7, (x,), {})
    with pytest.raises(ValueError, match=r"cotangent 1 is \[3, 6\] Float32, but output 1 is \[2, 6\]"):
        executor.preprocess_backward_taped(7, (None, random(3, WIDTH, seed=41)))
    assert list(executor.kept()) == [7]
    executor.preprocess_backward_taped(7, (random(2, WIDTH, seed=42), None))
    with pytest.raises(RuntimeError, match=r"key 7\) was already called"):
        executor.preprocess_backward_taped(7, (None, None))
    assert list(executor.kept()) == []


@pytest.mark.parametrize("mode", MODES)
def test_taped_preprocess_that_is_frozen_keeps_order_but_computes_nothing(mode: str) -> None:
    cell = named(Projector(), f"tpfrozen_{mode}.")
    for param in cell.trainable_params():
        param.requires_grad = False
    executor = create_executor(mode, {}, preprocess=cell)
    x = random(2, FEATURES, seed=43)
    outputs = executor.preprocess_forward_taped("k", (x,), {})
    for got, want in zip(outputs, cell(x), strict=True):
        assert_close(got, want, "frozen preprocess output")
    assert list(executor.kept()) == ["k"]
    executor.preprocess_backward_taped("k", (random(2, WIDTH, seed=44), None))
    assert list(executor.kept()) == [] and executor.grads() == {}
