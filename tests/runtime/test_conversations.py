"""Conversations with images -> samples -> batches (``graph_exec.data``), on one process.

The model directory is the tiny Qwen2-VL's ``config.json`` plus what
``graph_exec.examples.assets`` writes (a BPE tokenizer, the chat template, the image
processor); the data are examples/data's conversations and PNGs. Labels are checked against a
sample built by hand from the template's text; a batch of them trains through
``ScheduleMPipeTranspose`` (P = 2, ``loss_reduction="token"``) to the whole mindone model's
own losses and gradients on each sample alone (atol 1e-5, rtol 1e-4).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.data import (
    ChatProcessor,
    ConversationDataset,
    ConversationError,
    DataError,
    DataLoader,
    SampleError,
    conversation_collate,
)
from graph_exec.examples import assets, qwen2vl
from tests.models import mindone_models as mm
from tests.models.common import assert_matches

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
LAYERS = 2


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL's directory without weights: its config, tokenizer and processor."""
    folder = tmp_path_factory.mktemp("qwen2vl")
    config = qwen2vl.config(qwen2vl.SIZES["tiny"], LAYERS, qwen2vl.SIZES["tiny"].vision_depth)
    config.save_pretrained(str(folder))
    assets.write_tokenizer_and_processor(folder, config)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from graph_exec.examples import llama

    folder = tmp_path_factory.mktemp("llama")
    config = llama.config(llama.SIZES["tiny"], 2)
    config.save_pretrained(str(folder))
    assets.write_tokenizer_and_processor(folder, config)
    return folder


def write_lines(folder: Path, *records: dict, name: str = "data.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(user: str, answer: str, images=None) -> dict:
    record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    return record | ({"images": images} if images is not None else {})


# -- labels --------------------------------------------------------------------------------


def test_the_template_renders_as_qwen2_vls(qwen_dir):
    """The written template's text for images, a system turn and the generation prompt is
    Qwen2-VL's (its published rendering, written out here)."""
    data = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Yes."},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
    )
    assert data.processor.render(messages) == want
    assert data.processor.render(messages[1:2], generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_labels_are_the_assistants_tokens_of_a_hand_built_sample(qwen_dir):
    """Sample 1 (two images, 40x24 and 16x16 px) equals one built by hand: the template's text
    tokenized piece by piece, each image's ``<|image_pad|>`` widened to ``t·h·w/4`` tokens (the
    40x24 image is a 6x10 patch grid, the 16x16 one 4x4), ``-100`` on everything but the
    answer and its ``<|im_end|>``, shifted by one (``labels[i]`` is token ``i + 1``); the
    patches are the image processor's own, cut per image."""
    from PIL import Image

    data = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)
    tok = data.processor.tokenizer

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    img, S, E = qwen2vl.IMAGE_TOKEN, qwen2vl.VISION_START, qwen2vl.VISION_END
    prompt = (
        ids("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
        + [S] + [img] * 15 + [E] + [S] + [img] * 4 + [E]
        + ids("Which one is larger?<|im_end|>\n<|im_start|>assistant\n")
    )  # fmt: skip
    answer = ids("The first image is wider than the second one.<|im_end|>")
    tail = ids("\n")
    hand_ids = np.array(prompt + answer + tail)
    hf_labels = np.array([-100] * len(prompt) + answer + [-100] * len(tail))
    sample = data[1]
    np.testing.assert_array_equal(sample["input_ids"], hand_ids)
    np.testing.assert_array_equal(sample["labels"], np.append(hf_labels[1:], -100))
    assert tok.decode(answer) == "The first image is wider than the second one.<|im_end|>"
    pictures = [Image.open(DATA / "imgs" / n).convert("RGB") for n in ("blue.png", "red.png")]
    theirs = data.processor.processor.image_processor(images=pictures, return_tensors="np")
    assert [im["grid_thw"].tolist() for im in sample["images"]] == [[1, 6, 10], [1, 4, 4]]
    np.testing.assert_array_equal(theirs["image_grid_thw"], [[1, 6, 10], [1, 4, 4]])
    mine = np.concatenate([im["pixel_values"] for im in sample["images"]])
    np.testing.assert_array_equal(mine, theirs["pixel_values"])


def test_multi_turn_labels_cover_every_assistant_turn(qwen_dir):
    data = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)
    tok, sample = data.processor.tokenizer, data[2]
    learnt = [t for t in sample["labels"] if t >= 0]
    assert tok.decode(learnt) == "A cat sat on a mat.<|im_end|>It slept.<|im_end|>"
    assert sample["images"] == [] and sample["labels"][-1] == -100


def test_both_layouts_give_the_same_sample(qwen_dir, tmp_path):
    """llava.json's first record (``conversations``/``from``/``value``, ``image``, in a JSON
    array) and the same conversation as ``messages`` with ``images`` in JSON lines."""
    shutil.copytree(DATA / "imgs", tmp_path / "imgs")
    path = write_lines(
        tmp_path, chat("<image>\nDescribe the image.", "A red square on a light ground.", ["imgs/red.png"])
    )
    llava = ConversationDataset(DATA / "llava.json", qwen_dir)
    messages = ConversationDataset(path, qwen_dir)
    assert [c.line for c in llava.conversations] == [2, 9]
    a, b = llava[0], messages[0]
    for key in ("input_ids", "labels"):
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_array_equal(a["images"][0]["pixel_values"], b["images"][0]["pixel_values"])


def test_text_only_llama_goes_through_its_tokenizer(llama_dir):
    data = ConversationDataset(DATA / "conversations.jsonl", llama_dir, skip_bad_samples=True)
    assert len(data) == 2  # the two conversations without images
    assert [e.line for e in data.skipped] == [2, 4]
    assert "holds a text-only llama model" in str(data.skipped[0])
    tok, sample = data.processor.tokenizer, data[0]
    assert tok.decode(sample["input_ids"]).startswith(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>"
    )
    assert tok.decode([t for t in sample["labels"] if t >= 0]) == "I am fine, thank you.<|eot_id|>"
    (ids, positions), labels = conversation_collate(pad_token_id=data.processor.pad_token_id)(
        [data[0], data[1]]
    )
    assert (
        ids.shape == labels.shape == positions.shape and (labels[0, len(sample["input_ids"]) :] == -100).all()
    )


# -- max_length ----------------------------------------------------------------------------


def test_max_length_refuses_or_cuts(qwen_dir):
    full = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)[2]
    with pytest.raises(ConversationError, match=r"conversations.jsonl:3: 107 tokens, above max_length 100"):
        ConversationDataset(DATA / "conversations.jsonl", qwen_dir, max_length=100)[2]
    cut = ConversationDataset(DATA / "conversations.jsonl", qwen_dir, max_length=100, truncate=True)[2]
    np.testing.assert_array_equal(cut["input_ids"], full["input_ids"][:100])
    np.testing.assert_array_equal(cut["labels"][:-1], full["labels"][:99])
    assert cut["labels"][-1] == -100
    short = ConversationDataset(DATA / "conversations.jsonl", qwen_dir, max_length=30, truncate=True)
    with pytest.raises(
        ConversationError, match=r":2: cutting its 112 tokens at max_length 30 would cut through"
    ):
        short[1]
    with pytest.raises(ConversationError, match=r":1: no assistant token within max_length 30"):
        short[0]


# -- bad input -----------------------------------------------------------------------------


def test_bad_conversations_name_file_line_and_what(qwen_dir, tmp_path):
    shutil.copytree(DATA / "imgs", tmp_path / "imgs")
    (tmp_path / "imgs" / "broken.png").write_text("not a png")
    path = write_lines(
        tmp_path,
        chat("<image>Hi", "Yes.", ["imgs/nope.png"]),
        chat("<image>Hi", "Yes.", ["imgs/broken.png"]),
        chat("<image><image>Hi", "Yes.", ["imgs/red.png"]),
        chat("Hi", "Yes.", ["imgs/red.png"]),
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "robot", "content": "Hi"}]},
        chat("<image>Hi", "Yes.", ["imgs/red.png"]),
    )
    with pytest.raises(ConversationError, match=r"data.jsonl:3: 2 <image> tag\(s\) in the text but 1 image"):
        ConversationDataset(path, qwen_dir)
    data = ConversationDataset(path, qwen_dir, skip_bad_samples=True)
    reasons = {e.line: e.what for e in data.skipped}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6] and len(data) == 1
    assert reasons[1] == f"image 0 {str(tmp_path / 'imgs/nope.png')!r} does not exist"
    assert reasons[2].startswith(f"image 0 {str(tmp_path / 'imgs/broken.png')!r} cannot be read")
    assert (
        reasons[4]
        == "0 <image> tag(s) in the text but 1 image(s): each image needs one tag, in the order of the images"
    )
    assert reasons[5] == "the conversation has no assistant turn: nothing to learn from"
    assert reasons[6].startswith("turn 0 has role 'robot'; allowed: system, user")


def test_skipped_samples_are_logged_and_a_bad_one_raises_through_the_loader(qwen_dir, tmp_path, caplog):
    shutil.copytree(DATA / "imgs", tmp_path / "imgs")
    good = chat("<image>Hi", "Yes.", ["imgs/red.png"])
    path = write_lines(tmp_path, good, chat("<image>Hi", "Yes.", ["imgs/nope.png"]), good)
    with caplog.at_level(logging.WARNING, logger="graph_exec.data"):
        data = ConversationDataset(path, qwen_dir, skip_bad_samples=True)
    assert len(data) == 2
    assert f"skipping sample {path}:2: image 0" in caplog.text
    assert f"skipped 1 bad sample(s) of {path}" in caplog.text
    lazy = ConversationDataset(path, qwen_dir)
    loader = DataLoader(lazy, 3, shuffle=False, collate=conversation_collate(mm.whole("qwen2vl", LAYERS)))
    with pytest.raises(
        SampleError, match=rf"sample 1 cannot be read: ConversationError: {path}:2: image 0 .* does not exist"
    ):
        next(iter(loader))


def test_a_directory_without_processor_or_with_other_special_ids_is_refused(qwen_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(qwen_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(
        DataError, match=r"bare' has no processor: a Qwen2-VL directory needs preprocessor_config.json"
    ):
        ConversationDataset(DATA / "conversations.jsonl", bare)
    moved = tmp_path / "moved"
    shutil.copytree(qwen_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    config["image_token_id"] = 100
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        DataError,
        match=r"does not fit its config.json: <\|image_pad\|> is 124, config.json's image_token_id is 100",
    ):
        ConversationDataset(DATA / "conversations.jsonl", moved)
    untemplated = tmp_path / "untemplated"
    shutil.copytree(qwen_dir, untemplated)
    (untemplated / "chat_template.json").unlink()
    settings = json.loads((untemplated / "tokenizer_config.json").read_text())
    (untemplated / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": None}))
    with pytest.raises(DataError, match=r"untemplated' has no chat template"):
        ConversationDataset(DATA / "conversations.jsonl", untemplated)
    (bare / "tokenizer.json").unlink()
    for name in ("tokenizer_config.json", "chat_template.json"):
        (bare / name).unlink()
    with pytest.raises(DataError, match=r"bare' has no tokenizer"):
        ConversationDataset(DATA / "conversations.jsonl", bare)


def test_invalid_json_names_its_line(qwen_dir, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"messages": []},\n  {"messages": [\n]}\n]\n')
    with pytest.raises(ConversationError, match=r"bad.json:2: the conversation is empty"):
        ConversationDataset(path, qwen_dir)
    path.write_text('[\n  {"messages": [\n  }\n]\n')
    with pytest.raises(ConversationError, match=r"bad.json:3: not valid JSON"):
        ConversationDataset(path, qwen_dir)


# -- numerics ------------------------------------------------------------------------------


def token_reference(model, samples: list[dict]):
    """The whole model's own ``construct`` on each sample alone: each sample's summed token
    loss and label count, and the gradients of ``Σ sums / Σ counts`` by name."""
    params = model.trainable_params()
    total_count = sum(int((s["labels"] >= 0).sum()) for s in samples)

    def loss(ids, labels, *vision):
        pixels, grid = vision if vision else (None, None)
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
        return gm.causal_lm_token_loss(logits, labels)[0] / total_count

    grad_fn = ms.value_and_grad(loss, None, params)
    sums, total = [], None
    for sample in samples:
        vision = ()
        if sample["images"]:
            pixels = np.concatenate([im["pixel_values"] for im in sample["images"]])
            grid = np.stack([im["grid_thw"] for im in sample["images"]])
            vision = (ms.Tensor(pixels), ms.Tensor(grid))
        value, grads = grad_fn(
            ms.Tensor(sample["input_ids"][None]), ms.Tensor(sample["labels"][None]), *vision
        )
        sums.append(float(value.asnumpy()) * total_count)
        arrays = [g.asnumpy() for g in grads]
        total = arrays if total is None else [a + b for a, b in zip(total, arrays, strict=True)]
    return sums, {p.name: g for p, g in zip(params, total, strict=True)}


@pytest.mark.timeout(600)  # graph mode compiles both stages and the tower: minutes on a loaded CPU
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_a_batch_of_conversations_matches_the_whole_model_on_each_sample(qwen_dir, mode, trainable):
    """examples/data's four conversations (text-only; two images of 40x24 and 16x16 px;
    multi-turn text; one 24x16 image), batched by the loader with ``conversation_collate``
    into two micro-batches each padded to its own sizes: with ``loss_reduction="token"`` each
    micro-batch's loss is its samples' summed token losses over their label count, and every
    gradient is that of the global per-token mean, as the whole model gives on each sample."""
    from tests.runtime.test_vlm_batch import frozen_like

    model, ref = mm.whole("qwen2vl", LAYERS), mm.whole("qwen2vl", LAYERS)
    parts = gm.split_model(model, 2, trainable_preprocess=trainable)
    frozen_like(ref, parts)
    data = ConversationDataset(DATA / "conversations.jsonl", qwen_dir)
    collate = conversation_collate(parts, micro=2, pad_token_id=data.processor.pad_token_id)
    batches = next(iter(DataLoader(data, 4, shuffle=False, collate=collate)))
    assert [b.inputs[3].shape for b in batches] == [(2, 112), (2, 107)]
    stages = [ge.PipelineStage(cell, k, 2) for k, cell in enumerate(parts.stages)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        2,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=mode,
        loss_fn=gm.causal_lm_token_loss,
        loss_reduction="token",
    )
    losses = sched.run(micro_batches=batches)
    samples = [data[k] for k in range(4)]
    sums, ref_grads = token_reference(ref, samples)
    counts = [int((s["labels"] >= 0).sum()) for s in samples]
    ref_losses = [
        (sums[0] + sums[1]) / (counts[0] + counts[1]),
        (sums[2] + sums[3]) / (counts[2] + counts[3]),
    ]
    assert_matches(sched, losses, ref_losses, ref_grads)


def test_the_docs_fine_tuning_block_trains_on_the_example_conversations(tmp_path):
    """docs/models.md's "Fine-tuning on your conversations" block, as shown, in a process of its
    own: the directory's assets written, the example conversations batched and one step run."""
    from tests.runtime.test_readme_snippets import _python_block_of, _run

    script = tmp_path / "finetune.py"
    script.write_text(
        _python_block_of("Fine-tuning on your conversations", "docs/models.md"), encoding="utf-8"
    )
    done = _run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("loss per assistant token")]
    assert len(lines) == 1, done.stdout
    assert all(np.isfinite(float(x)) for x in lines[0].split("[", 1)[1].rstrip("]").split(","))


def test_loading_the_processor_keeps_quiet_about_its_tokenizer_fallback(qwen_dir, capfd):
    """mindone warns (on its own stderr handler) that it takes transformers' tokenizer class, as it
    should for a tokenizer: dropped while the library loads the processor; the same note for a
    class that is not a tokenizer still passes the filter."""
    from graph_exec.models.quiet import _DropNoise

    ChatProcessor(qwen_dir)
    assert "Falling back" not in capfd.readouterr().err

    def passes(message: str) -> bool:
        return _DropNoise().filter(logging.LogRecord("mindone", logging.WARNING, "", 0, message, None, None))

    assert not passes("Falling back to 🤗 Transformers `Qwen2TokenizerFast`. Note that ...")
    assert passes("Falling back to 🤗 Transformers `Qwen2VLImageProcessorFast`. Note that ...")
