"""The split backward (``body="zb"``: ``I`` + ``W`` steps) on one process, and its executor hooks.

Losses and every gradient are checked against the non-pipelined reference (atol 1e-5,
rtol 1e-4); the multi-rank cases are in tests/multirank/test_zero_bubble.py.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, mint, nn

from graph_exec.executors import HookOrderError, create_executor
from tests.models.common import ATOL, RTOL, loss_fn, named
from tests.models.pipeline import batch, build, reference
from tests.runtime.test_fair_baseline import baseline
from tests.runtime.test_single_process import assert_matches, schedule


def _walked(sched):
    return [event.step for event in sched.timeline]


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("preprocess", ["trainable", "frozen", "none"])
def test_zb_one_rank_matches_reference(mode, preprocess):
    model, ref = build(3, preprocess), build(3, preprocess)
    x, labels = batch(8)
    sched = schedule(model, 4, mode=mode, scale_grads=True, body="zb")
    ref_losses, ref_grads = reference(ref, x, labels, 4, scale=0.25)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    tokens = _walked(sched)
    assert sched.plan.config.split_backward and not any(t.startswith("B") for t in tokens)
    assert sum(t.startswith("I") for t in tokens) == sum(t.startswith("W") for t in tokens) == 12
    assert not sched._setup.executor.kept()
    # A second step without zero_grad adds up: nothing held leaked from the first.
    losses = sched.run(x, labels=labels)
    assert_matches(sched, losses, ref_losses, {k: 2 * v for k, v in ref_grads.items()})
    # The second step's forwards are probed: I holds the linear layers' inputs and output
    # gradients for W, and the memory accounting counts them.
    assert sched.stats()["memory"]["held_weight_gradients"] > 0


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_zb_fair_baseline_one_rank_matches_reference(mode):
    model, ref = build(3, "trainable"), build(3, "trainable")
    x, labels = batch(8)
    sched = baseline(model, 4, mode=mode, body="zb")
    ref_losses, ref_grads = reference(ref, x, labels, 4)
    assert_matches(sched, sched.run(x, labels=labels), ref_losses, ref_grads)
    tokens = _walked(sched)
    # TBWD m follows I 0.m: the preprocess backward does not wait for the deferred W 0.m.
    for m in range(4):
        assert tokens.index(f"TBWD{m}") == tokens.index(f"I0.{m}") + 1


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_split_hooks_equal_the_whole_backward(mode):
    """stage_backward_input + stage_backward_weight give stage_backward's gradients, with
    forwards of several micro-batches in flight and the halves out of order (weight gradients
    up to the order of the adds, atol 1e-5 / rtol 1e-4)."""
    x, _ = batch(8)
    cot = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    results = []
    for split in (False, True):
        model = build(2, "none")
        ex = create_executor(mode, {0: model.stages[0]}, loss_fn=loss_fn, last_stage=1)
        outs = [ex.stage_forward(0, m, (x,)) for m in range(3)]
        assert all(o[0].shape == (8, 8) for o in outs)
        grads_in = {}
        for m in (1, 0, 2):
            if split:
                grads_in[m] = ex.stage_backward_input(0, m, (Tensor(cot * (m + 1)),))
            else:
                grads_in[m] = ex.stage_backward(0, m, (Tensor(cot * (m + 1)),))
        if split:
            assert sorted(ex.kept()) == [("weight_grads", 0, m) for m in range(3)]
            assert all(not np.any(g.asnumpy()) for g in ex.grads().values())  # nothing added yet
            for m in (2, 0, 1):
                ex.stage_backward_weight(0, m)
            with pytest.raises(HookOrderError, match=r"stage_backward_weight\(stage 0, micro 1\)"):
                ex.stage_backward_weight(0, 1)
        assert not ex.kept()
        results.append(
            (
                {m: g[0].asnumpy() for m, g in grads_in.items()},
                {k: v.asnumpy() for k, v in ex.grads().items()},
            )
        )
    (whole_in, whole_w), (split_in, split_w) = results
    for m in whole_in:  # the same bprop: bit for bit
        np.testing.assert_array_equal(split_in[m], whole_in[m])
    assert set(split_w) == set(whole_w)
    for name in whole_w:
        np.testing.assert_allclose(split_w[name], whole_w[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_held_weight_gradients_are_dropped_on_abort():
    model = build(2, "none")
    ex = create_executor("graph", {0: model.stages[0]}, loss_fn=loss_fn, last_stage=1)
    x, _ = batch(4)
    out = ex.stage_forward(0, 0, (x,))
    ex.stage_backward_input(0, 0, (out[0],))
    assert ex.kept() == [("weight_grads", 0, 0)]
    ex.drop_kept()
    assert not ex.kept()


def test_a_bad_body_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match=r"body must be one of 'interleaved', '1f1b', 'gpipe', 'zb', got 'zz'"
    ):
        schedule(build(2, "none"), 2, body="zz")


# ------------------------------------------------------------------ the real weight pass


class _Varied(nn.Cell):
    """Every case the linear split must get right: a Dense on 3-D input with an activation, a
    mint Linear on 3-D input, a Dense called twice (its gradient stays in I), a Dense whose
    weight another cell holds (tied: stays in I), a LayerNorm (a small weight, in I)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Dense(8, 8, activation="tanh")
        self.lin = mint.nn.Linear(8, 8)
        self.twice = nn.Dense(8, 8, has_bias=False)
        self.norm = nn.LayerNorm((8,))
        self.table = nn.Dense(8, 8)
        self.tied = nn.Dense(8, 8, weight_init=self.table.weight)
        self.tied.weight = self.table.weight

    def construct(self, x):
        h = self.twice(self.twice(self.lin(self.act(x))))
        return self.norm(self.tied(self.table(h)) + h)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("chunk", ["pipeline", "varied"])
def test_forwards_recorded_for_the_split_equal_the_whole_backward(mode, chunk):
    """After a stage's first input backward its forwards are probed: I returns the input
    gradients of stage_backward bit for bit, W computes the linear layers' weight gradients
    from what I saved (a LinearWork held, not gradients), and the sums equal stage_backward's
    (atol 1e-5 / rtol 1e-4); the user's layers are the user's again afterwards."""
    rng = np.random.default_rng(5)
    shape, out_shape = ((8, 6), (8, 8)) if chunk == "pipeline" else ((2, 4, 8), (2, 4, 8))
    x = Tensor(rng.standard_normal(shape).astype(np.float32))
    cot = [Tensor(rng.standard_normal(out_shape).astype(np.float32)) for _ in range(4)]
    results = []
    for split in (False, True):
        ms.set_seed(0)
        cell = build(2, "none").stages[0] if chunk == "pipeline" else named(_Varied(), "v.")
        names = [p.name for p in cell.trainable_params()]
        ex = create_executor(mode, {0: cell}, loss_fn=loss_fn, last_stage=1)
        grads_in = {}
        if split:  # micro 0 teaches the executor that stage 0 splits; its forward was not probed
            ex.stage_forward(0, 0, (x,))
            grads_in[0] = ex.stage_backward_input(0, 0, (cot[0],))
            outs = [ex.stage_forward(0, m, (x * m,)) for m in (1, 2, 3)]
            for m in (2, 1, 3):
                grads_in[m] = ex.stage_backward_input(0, m, (cot[m],))
            held = {key[2]: type(ex._held[key[1:]]).__name__ for key in ex.kept()}
            assert held == {0: "tuple", 1: "LinearWork", 2: "LinearWork", 3: "LinearWork"}
            work = ex._held[(0, 1)]
            in_w = {id(p) for p in work.split.split.params()}
            assert in_w and not in_w & {id(p) for p in work.split.small}  # not differentiated in I
            assert not any(np.any(g.asnumpy()) for g in ex.grads().values())  # nothing added yet
            for m in (3, 0, 2, 1):
                ex.stage_backward_weight(0, m)
        else:
            outs = []
            for m in range(4):
                outs.append(ex.stage_forward(0, m, (x * m if m else x,)))
                grads_in[m] = ex.stage_backward(0, m, (cot[m],))
            outs = outs[1:]
        assert not ex.kept()
        assert [p.name for p in cell.trainable_params()] == names  # no probe joined the user's cell
        assert all(
            type(c) in (nn.Dense, mint.nn.Linear) or not isinstance(c, nn.Dense | mint.nn.Linear)
            for _, c in cell.cells_and_names()
        )
        assert not any(k.startswith("_ge_zb") for _, c in cell.cells_and_names() for k in vars(c))
        results.append(
            (
                [o[0].asnumpy() for o in outs],
                {m: g[0].asnumpy() for m, g in grads_in.items()},
                {k: v.asnumpy() for k, v in ex.grads().items()},
            )
        )
    (whole_out, whole_in, whole_w), (split_out, split_in, split_w) = results
    for a, b in zip(split_out, whole_out, strict=True):
        np.testing.assert_array_equal(a, b)  # probes add zeros: the same outputs
    for m in whole_in:
        np.testing.assert_allclose(split_in[m], whole_in[m], atol=ATOL, rtol=RTOL, err_msg=f"dx {m}")
    assert set(split_w) == set(whole_w)
    for name in whole_w:
        assert np.any(whole_w[name]), name
        np.testing.assert_allclose(split_w[name], whole_w[name], atol=ATOL, rtol=RTOL, err_msg=name)


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_last_stage_held_step_computes_its_weight_pass(mode):
    """last_stage_step(hold_weight_grads=True) holds the linear layers' inputs and output
    gradients; the W steps give the unsplit step's gradients; loss and input gradients equal."""
    _, labels = batch(8)
    h = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    results = []
    for hold in (False, True):
        ex = create_executor(mode, {1: build(2, "none").stages[1]}, loss_fn=loss_fn, last_stage=1)
        steps = [
            ex.last_stage_step(1, m, (Tensor(h * (m + 1)),), (labels,), hold_weight_grads=hold)
            for m in range(3)
        ]
        if hold:
            assert {type(w).__name__ for w in ex._held.values()} == {"LinearWork"}
            for m in (2, 0, 1):
                ex.stage_backward_weight(1, m)
        assert not ex.kept()
        results.append((steps, {k: v.asnumpy() for k, v in ex.grads().items()}))
    (whole, whole_w), (split, split_w) = results
    for (loss, dx), (loss2, dx2) in zip(whole, split, strict=True):
        assert float(loss) == float(loss2)
        np.testing.assert_array_equal(dx[0].asnumpy(), dx2[0].asnumpy())
    for name in whole_w:
        np.testing.assert_allclose(split_w[name], whole_w[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_bench_body_reaches_every_run():
    """``graph-exec bench --body zb``: every run (baselines too) has the split backward."""
    from graph_exec.cli import build_parser
    from graph_exec.cli.bench import job_from_args

    parser = build_parser("bench")
    job = job_from_args(parser.parse_args(["bench", "--body", "zb", "--variants", "frozen-full"]), parser)
    assert job.runs and all(spec.body == "zb" and job.plan_config(spec).split_backward for spec in job.runs)
    (default,) = {spec.body for spec in job_from_args(parser.parse_args(["bench"]), parser).runs}
    assert default == "interleaved"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--body", "zz"])


@pytest.mark.parametrize(("name", "mode"), [("llama", "pynative"), ("qwen2", "graph")])
def test_zb_on_mindone_models_matches_the_whole_model(name, mode):
    """A real transformer (mint.nn.Linear projections split off into W; RMSNorm, embeddings in
    I): two steps of body "zb" with MPipe give the whole mindone model's losses and gradients
    (atol 1e-5 / rtol 1e-4) and every W of the second step forms linear weight gradients."""
    import graph_exec as ge
    import graph_exec.models as gm
    from tests.models import mindone_models as mm

    model, ref = mm.whole(name), mm.whole(name)
    parts = gm.split_model(model, 2, **({} if name == "llama" else {"preprocess": "none"}))
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        2,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
        body="zb",
    )
    inputs, labels = mm.batch(name, ref, 4)
    ref_losses, ref_grads = mm.reference(name, ref, inputs, labels, 2, scale=0.5)
    assert_matches(sched, sched.run(*inputs, labels=labels), ref_losses, ref_grads)
    executor, held = sched._setup.executor, []
    original = executor.stage_backward_weight

    def recording(stage, micro):
        held.append(type(executor._held[(stage, micro)]).__name__)
        original(stage, micro)

    executor.stage_backward_weight = recording
    sched.zero_grad()
    assert_matches(sched, sched.run(*inputs, labels=labels), ref_losses, ref_grads)
    assert len(held) == 4 and set(held) == {"LinearWork"}
