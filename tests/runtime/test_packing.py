"""Packed rows (``graph_exec.data.pack`` + ``graph_exec.models.*_packed_micro_batches``) on one
process holding both stages (P = 2).

A packed row holds examples/data's text-only conversation, the one with two images of
different sizes (40x24 and 16x16 px) and the multi-turn one; the other micro-batch the fourth
(one image). Each sample's summed token loss, read from the packed row's logits by its segment,
equals the whole mindone model's own ``construct`` on that sample alone; the step's
per-micro-batch losses (``loss_reduction="token"``) and every gradient equal the whole model's
gradient of the global per-token mean (atol 1e-5, rtol 1e-4): all four of graph and pynative
by frozen and trainable tower (the reference computed once, every parameter trainable; a frozen
tower's case drops the tower's gradients from it). Llama text rows the same way. Unit checks of
the packer's balance and determinism: tests/unit/test_packer.py.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.data import ConversationDataset, SampleCost, pack
from tests.models import mindone_models as mm
from tests.models.common import ATOL, RTOL, assert_matches
from tests.runtime.test_conversations import DATA, LAYERS, qwen_dir, token_reference  # noqa: F401

MAX_LENGTH = 300


def schedule(parts, mode):
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    return ge.ScheduleMPipeTranspose(
        stages,
        2,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_token_loss,
        loss_reduction="token",
    )


def segment_sums(parts, batch) -> dict[int, float]:
    """Each segment's summed token loss of row 0 of ``batch``, from the split's own cells run
    one after the other (no schedule): what each packed sample contributes."""
    tensors = [ms.Tensor(a) for a in batch.inputs]
    hidden = parts.preprocess(*tensors) if parts.preprocess is not None else tensors
    for stage in parts.stages:
        hidden = stage(*hidden) if isinstance(hidden, tuple | list) else stage(hidden)
    segments = batch.inputs[-1][0]
    sums = {}
    for k in range(1, int(segments.max()) + 1):
        labels = np.where(segments == k, batch.labels[0], -100)[None]
        total, _ = gm.causal_lm_token_loss(hidden[:1], ms.Tensor(labels))
        sums[k] = float(total.asnumpy())
    return sums


@pytest.fixture(scope="module")
def conversations(qwen_dir):  # noqa: F811
    """examples/data's conversations read once for the module: the dataset and its first four samples."""
    data = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)
    return data, [data[k] for k in range(4)]


@pytest.fixture(scope="module")
def whole_reference(conversations):
    """The whole model on each sample alone with every parameter trainable, computed once: a
    frozen tower's reference is the same without the tower's gradients (freezing a parameter
    drops its gradient and changes no other)."""
    return token_reference(mm.whole("qwen2vl", LAYERS), conversations[1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_a_packed_row_matches_the_whole_model_on_each_sample_alone(
    conversations, whole_reference, mode, trainable
):
    data, samples = conversations
    parts = gm.split_model(mm.whole("qwen2vl", LAYERS), 2, trainable_preprocess=trainable)
    costs = gm.vlm_sample_costs(parts, samples)
    assert costs[1] == SampleCost(112, 76, 15 + 4 + 2 * 2)  # grids 6x10 and 4x4, merge 2, framed
    with pytest.raises(ValueError, match=r"max_length 20 is below the 23 tokens of sample 1's images"):
        pack(costs, 20, 2)
    with pytest.raises(ValueError, match=r"sample 1 has 112 tokens, above max_length 100"):
        pack(costs, 100, 2)
    packing = pack(costs, MAX_LENGTH, 2, balance="tokens")
    assert packing.micro_batches == (((1, 2, 0),), ((3,),))  # two images, multi-turn, text-only
    batches = gm.vlm_packed_micro_batches(
        parts, samples, packing, MAX_LENGTH, patch_pad_to=(32, 128), pad_token_id=data.processor.pad_token_id
    )
    pixels, patch_image, _, ids, positions, segments = batches[0].inputs
    assert ids.shape == (1, MAX_LENGTH) and pixels.shape[1] == 128
    assert patch_image[0, :76].tolist() == [0] * 60 + [1] * 16 and (patch_image[0, 76:] == -1).all()
    starts = np.flatnonzero(np.diff(segments[0], prepend=0) > 0)
    assert starts.tolist() == [0, 112, 219] and (positions[0, :, starts[1:]] == 0).all()  # restart
    sums, all_grads = whole_reference
    frozen = {p.name for p in parts.preprocess.get_parameters() if not p.requires_grad}
    assert bool(frozen) != trainable
    ref_grads = {name: g for name, g in all_grads.items() if name not in frozen}
    if mode == "pynative":
        got = segment_sums(parts, batches[0])
        np.testing.assert_allclose(
            [got[1], got[2], got[3]], [sums[1], sums[2], sums[0]], atol=ATOL, rtol=RTOL
        )
    sched = schedule(parts, mode)
    losses = sched.run(micro_batches=batches)
    counts = [int((s["labels"] >= 0).sum()) for s in samples]
    ref_losses = [(sums[0] + sums[1] + sums[2]) / (counts[0] + counts[1] + counts[2]), sums[3] / counts[3]]
    assert_matches(sched, losses, ref_losses, ref_grads)


@pytest.mark.parametrize("ragged", [False, True], ids=["even", "ragged"])
def test_packed_llama_text_rows_match_the_whole_model_on_each_sample(ragged):
    """Five samples of 3..11 tokens in rows of 16: losses and every gradient as the whole Llama
    on each sample alone (pynative; the masked chunks compile in the Qwen2-VL graph case); with
    ``ragged=True`` the micro-batches hold 1 and 2 rows (the batch's three best-fit rows)."""
    model, ref = mm.whole("llama", 2), mm.whole("llama", 2)
    parts = gm.split_model(model, 2, packed=True)
    samples = mm.text_samples([11, 5, 9, 3, 7])
    packing = pack(gm.text_sample_costs(samples), 16, 2, ragged=ragged)
    assert max(len(row) for mb in packing.micro_batches for row in mb) >= 2
    assert sorted(packing.row_counts) == ([1, 2] if ragged else [2, 2])
    batches = gm.text_packed_micro_batches(samples, packing, 16)
    sched = schedule(parts, "pynative")
    losses = sched.run(micro_batches=batches)
    sums, ref_grads = mm.text_reference(ref, samples)
    counts = [int((s["labels"] >= 0).sum()) for s in samples]
    ref_losses = [
        sum(sums[i] for row in mb for i in row) / sum(counts[i] for row in mb for i in row)
        for mb in packing.micro_batches
    ]
    assert_matches(sched, losses, ref_losses, ref_grads)
    # Memory: a micro-batch's held stage inputs (and stage 0's taped outputs, the same shapes) are
    # rows x max_length tokens of (hidden float32, positions, segment ids), whatever the samples'
    # lengths: bounded by the budget, not by the longest sample times the rows.
    inputs = batches[0][0]
    per_token = model.config.hidden_size * 4 + np.asarray(inputs[1]).itemsize + np.asarray(inputs[2]).itemsize
    row_bytes = packing.rows * 16 * per_token
    assert sched.stats()["memory"]["activation_bytes_per_micro"] == {0: 2 * row_bytes, 1: row_bytes}


def test_the_packing_collate_packs_each_loader_batch():
    """``packing_collate`` through the loader: each batch of samples packed as ``pack`` +
    ``text_packed_micro_batches`` pack it (the same on every rank: sizes and seed only), with
    even rows and ragged ones; options ``pack`` refuses are refused when the collate is made."""
    from graph_exec.data import DataLoader, packing_collate, row_buckets_upto

    samples = mm.text_samples([11, 5, 9, 3, 7, 2, 14, 6])
    layouts = ({"rows": 1}, {"ragged": True, "row_buckets": row_buckets_upto(4)})
    for layout in layouts:
        collate = packing_collate(micro=2, max_length=16, **layout)
        seen = 0
        for k, batches in enumerate(DataLoader(samples, 4, shuffle=False, collate=collate)):
            seen += 1
            part = samples[4 * k : 4 * k + 4]
            packing = pack(gm.text_sample_costs(part), 16, 2, **layout)
            want = gm.text_packed_micro_batches(part, packing, 16)
            assert [len(inputs[0]) for inputs, _ in batches] == packing.row_counts
            for (inputs, labels), (want_inputs, want_labels) in zip(batches, want, strict=True):
                for a, b in zip((*inputs, labels), (*want_inputs, want_labels), strict=True):
                    np.testing.assert_array_equal(np.asarray(a), b)
        assert seen == 2
    with pytest.raises(ValueError, match=r"give rows=1 \(every micro-batch that many\) or ragged=True"):
        packing_collate(micro=2, max_length=16, rows=1, ragged=True)
    with pytest.raises(ValueError, match=r"row_buckets=\(2, 1\): a non-empty increasing tuple"):
        packing_collate(micro=2, max_length=16, row_buckets=(2, 1))


def test_a_packing_reuses_the_compiled_shapes():
    """With ``rows`` fixed, two packings of different samples give micro-batches of the same
    shapes (rows × max_length), so graph mode compiles once; too few rows is refused."""
    a = pack([SampleCost(n) for n in (11, 5, 9, 3, 7)], 16, 2, rows=2)
    b = pack([SampleCost(n) for n in (2, 14, 6, 6, 8, 1)], 16, 2, rows=2)
    shapes = {
        tuple(x.shape for x in inputs)
        for p, lengths in ((a, [11, 5, 9, 3, 7]), (b, [2, 14, 6, 6, 8, 1]))
        for inputs, _ in gm.text_packed_micro_batches(mm.text_samples(lengths), p, 16)
    }
    assert shapes == {((2, 16),) * 3}
    with pytest.raises(ValueError, match=r"need 2 rows of max_length 16 in some micro-batch, above rows=1"):
        pack([SampleCost(n) for n in (11, 5, 9, 3, 7)], 16, 2, rows=1)
