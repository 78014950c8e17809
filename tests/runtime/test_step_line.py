"""The step line says when a step compiled: the first step's graphs, and a later step's new
shape (``shapes="dynamic"``), which costs seconds against a fraction of one; on real data it
says the real (non-pad) tokens per second and the padding fraction."""

from __future__ import annotations

import json
from types import SimpleNamespace

from graph_exec.cli.run import progress_text
from graph_exec.data import SampleCost
from graph_exec.examples.common import ConversationSource, GeneratedSource
from graph_exec.harness.training import Trainer
from graph_exec.report.job import PROGRESS
from graph_exec.report.records import StepRecord


def record(step: int, compilations: int, seconds: float) -> StepRecord:
    return StepRecord(step, 0.0, 1.0, (), 2.5, compilations, seconds, 0)


def lines(records: list[StepRecord], capsys, token_counts=None) -> list[dict]:
    trainer = SimpleNamespace(
        records=[],
        spec=SimpleNamespace(name="run"),
        _samples=None,
        model=SimpleNamespace(token_counts=token_counts),
        job=SimpleNamespace(batch=2),
    )
    out = []
    for rec in records:
        trainer.records.append(rec)
        Trainer.report(trainer, rec, None)
        out.append(json.loads(capsys.readouterr().out.removeprefix(PROGRESS)))
    return out


def test_a_step_that_compiled_a_new_shape_is_marked(capsys):
    first, same, new = lines([record(0, 12, 9.0), record(1, 12, 9.0), record(2, 15, 19.5)], capsys)
    assert first["compiled"] == {"graphs": 12, "seconds": 9.0, "first": True}
    assert "compiled" not in same
    assert new["compiled"] == {"graphs": 3, "seconds": 10.5, "first": False}
    assert progress_text(first, 3).endswith("  compiled 12 graph(s) in 9.0 s")
    assert "compiled" not in progress_text(same, 3)
    assert progress_text(new, 3).endswith("  compiled 3 graph(s) for a new shape in 10.5 s")


def test_real_data_steps_say_their_real_tokens_per_second_and_padding(capsys):
    """Two samples of 3 and 5 tokens padded to 5: 8 real of 10, in a step of 1 s (``record``)."""
    source = ConversationSource([{"input_ids": [7] * 3}, {"input_ids": [7] * 5}], "two samples")
    assert source.token_counts(0, 2) is None  # before its samples are made
    assert [len(s["input_ids"]) for s in source.samples(0, 2)] == [3, 5]
    assert source.token_counts(0, 2) == (8, 10)
    (line,) = lines([record(0, 0, 0.0)], capsys, token_counts=source.token_counts)
    assert line["tokens"] == {"real": 8, "padded": 10}
    assert progress_text(line, 1).endswith("  8 real tokens/s, padding 20%")
    (plain,) = lines([record(0, 0, 0.0)], capsys)
    assert "tokens" not in plain and "real tokens" not in progress_text(plain, 1)


def test_with_replicas_the_step_loss_is_the_global_per_token_mean():
    """dp = 2, packed shards of different labelled tokens: the step line's loss is the replicas'
    per-token means weighted by their tokens (the global per-token mean, as the gradients are),
    not the mean of the two means. This replica: 2.0 over 30 + 10 tokens; the other 5.0 over 20."""
    import mindspore as ms

    class OtherReplica:
        def all_reduce_sum(self, tensors: list) -> None:
            (total,) = tensors
            total.assign_value(total + ms.Tensor([5.0 * 20, 20.0], ms.float32))

    trainer = SimpleNamespace(
        _token_loss=True,
        _label_counts=[30, 10],
        _loss_group=OtherReplica(),
        mesh=SimpleNamespace(dp_size=2),
    )
    losses = [ms.Tensor(2.0, ms.float32), ms.Tensor(2.0, ms.float32)]
    assert Trainer._mean_loss(trainer, losses) == (2.0 * 40 + 5.0 * 20) / 60
    plain = SimpleNamespace(**{**vars(trainer), "_token_loss": False})
    plain._loss_group = SimpleNamespace(
        all_reduce_sum=lambda tensors: tensors[0].assign_value(tensors[0] + ms.Tensor([5.0, 1.0], ms.float32))
    )
    assert Trainer._mean_loss(plain, losses) == (2.0 + 5.0) / 2  # the mean loss: the replicas' mean


def test_run_packing_rounds_the_rows_up_to_a_bucket():
    """``run --packing``'s source (``ConversationSource.packed``): ten samples of 8 tokens in one
    micro-batch of rows of 16 need 5 rows, given 6 (``row_buckets_upto(10)``), the sixth empty;
    the step line's slots count it."""
    source = GeneratedSource(lambda step, batch: [{"input_ids": [7] * 8} for _ in range(batch)], "")
    made = []
    source.packed(
        0, 10, 1, 16, lambda s: [SampleCost(len(x["input_ids"])) for x in s], lambda s, p: made.append(p)
    )
    (packing,) = made
    assert packing.rows == 6 and [len(row) for row in packing.micro_batches[0]] == [2, 2, 2, 2, 2, 0]
    assert source.token_counts(0, 10) == (80, 6 * 16)
