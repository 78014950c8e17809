"""Early checks a new user meets first (issue #12), on one process (P = 1, no communication).

Duplicate parameter names fail at construction with the fix; ``trainable_params()`` never
hides a parameter; an inline lambda ``loss_fn`` trains in graph mode; numpy batches are
accepted. Numbers are checked against the non-pipelined reference (atol 1e-5, rtol 1e-4).
"""

import numpy as np
import pytest
from mindspore import nn, ops

import graph_exec as ge
from graph_exec.executors.jit_callable import jit_parseable
from tests.models.common import ATOL, RTOL, loss_fn
from tests.models.pipeline import batch, build, reference
from tests.runtime.test_single_process import assert_matches


class Two(nn.Cell):
    """A chunk whose parameters are named from itself (``fc1.weight``, ``fc2.weight``)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Dense(width, width)
        self.fc2 = nn.Dense(width, width)

    def construct(self, x):
        return self.fc2(ops.tanh(self.fc1(x)))


def test_duplicate_parameter_names_across_chunks_rejected_at_construction():
    chunks = [Two(), Two()]  # a plain list: both name their weights fc1.weight, ...
    stages = [ge.PipelineStage(c, k, 2) for k, c in enumerate(chunks)]
    with pytest.raises(
        ValueError, match=r"duplicate parameter name 'fc1\.weight'.*stage 0 and in stage 1"
    ) as err:
        ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn)
    assert "update_parameters_name" in str(err.value) and "CellList" in str(err.value)


def test_duplicate_name_between_preprocess_and_chunk_rejected():
    pre, body, head = Two(), Two(), Two()
    body.update_parameters_name("body.")
    stages = [ge.PipelineStage(body, 0, 2), ge.PipelineStage(head, 1, 2)]
    with pytest.raises(ValueError, match="stage 1 and in the preprocess module"):
        ge.ScheduleMPipeTranspose(stages, 2, pre, 1, loss_fn=loss_fn)


def test_trainable_params_lists_every_parameter_once():
    chunks = nn.CellList([Two(), Two()])  # names get the index: 0.fc1.weight, 1.fc1.weight
    stages = [ge.PipelineStage(c, k, 2) for k, c in enumerate(chunks)]
    shared = ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn)
    params = shared.trainable_params()
    assert len(params) == 8 and len({id(p) for p in params}) == 8


def lambda_schedule(model, scale):
    stages = [ge.PipelineStage(c, k, len(model.stages)) for k, c in enumerate(model.stages)]
    # Inline, sharing its line with other code, and reading a closure variable: as users write it.
    return ge.ScheduleMPipeTranspose(stages, 4, model.preprocess, 1, mode="graph", scale_grads=True, loss_fn=lambda out, y: ops.cross_entropy(out, y, reduction="mean") * scale)  # fmt: skip


def test_inline_lambda_loss_fn_trains_in_graph_mode():
    model, ref = build(3, "trainable"), build(3, "trainable")
    x, labels = batch(8)
    sched = lambda_schedule(model, 2.0)
    losses = sched.run(x, labels=labels)
    ref_losses, ref_grads = reference(ref, x, labels, 4, scale=0.25 * 2.0)
    np.testing.assert_allclose(
        [float(loss.asnumpy()) for loss in losses], [2.0 * v for v in ref_losses], atol=ATOL, rtol=RTOL
    )
    grads = sched.grads()
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        np.testing.assert_allclose(grad.asnumpy(), ref_grads[name], atol=ATOL, rtol=RTOL, err_msg=name)


def test_loss_fn_without_source_rejected_at_construction_with_the_fix():
    namespace: dict = {}
    exec("def made(out, y):\n    return (out - y).mean()\n", namespace)
    with pytest.raises(TypeError, match=r"no source file .* define it with def"):
        jit_parseable(namespace["made"])
    model = build(2, "none")
    stages = [ge.PipelineStage(c, k, 2) for k, c in enumerate(model.stages)]
    with pytest.raises(TypeError, match="loss_fn"):
        ge.ScheduleMPipeTranspose(stages, 2, mode="graph", loss_fn=namespace["made"])
    ge.ScheduleMPipeTranspose(stages, 2, mode="pynative", loss_fn=namespace["made"])  # eager: fine


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_numpy_inputs_and_labels_are_accepted(mode):
    model, ref = build(3, "trainable"), build(3, "trainable")
    x, labels = batch(8)
    stages = [ge.PipelineStage(c, k, 3) for k, c in enumerate(model.stages)]
    sched = ge.ScheduleMPipeTranspose(stages, 4, model.preprocess, 1, mode=mode, loss_fn=loss_fn)
    losses = sched.run(x.asnumpy(), labels=labels.asnumpy())
    assert_matches(sched, losses, *reference(ref, x, labels, 4))


def test_other_input_types_named_with_the_conversion():
    model = build(2, "none")
    stages = [ge.PipelineStage(c, k, 2) for k, c in enumerate(model.stages)]
    sched = ge.ScheduleMPipeTranspose(stages, 2, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"input 0 must be a mindspore.Tensor or a numpy.ndarray, got list"):
        sched.run([[1.0]], labels=batch(2)[1])


def test_usage_example_runs_as_one_process_and_matches_the_plain_run(capsys, monkeypatch):
    """examples/train_custom.py without msrun: every stage local, same losses as no pipeline."""
    from graph_exec.examples import train_custom
    from tests.multirank import test_train_custom as custom  # its reference, not its test

    monkeypatch.delenv("MS_ROLE", raising=False)
    argv = ["--steps", str(custom.STEPS), "--vpp", "4", "--micro", str(custom.MICRO)]
    train_custom.main(
        [*argv, "--batch", str(custom.BATCH), "--lr", str(custom.LR), "--max-norm", str(custom.MAX_NORM)]
    )
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [int(words[1]) for words in printed] == list(range(1, custom.STEPS + 1))
    expected = custom.reference_losses(4)
    np.testing.assert_allclose([float(words[3]) for words in printed], expected, atol=1e-5, rtol=1e-4)
