"""``graph-exec run llama|qwen2vl --pretrained DIR --dataset FILE`` without launching: the flags
reach the job, the whole data set is prepared before msrun would start (a bad sample exits with
code 2 naming its file and line; ``--skip-bad-samples`` names and counts them), and the
examples build their batches from the conversations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from graph_exec.cli import jobs, main
from graph_exec.cli.run import job_from_args
from graph_exec.examples import assets, qwen2vl
from tests.runtime.test_conversations import DATA, chat, write_lines


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-VL pretrained directory (make_pretrained's weights) with its processor."""
    from graph_exec.examples.make_pretrained import make_pretrained

    folder = tmp_path_factory.mktemp("models") / "qwen2vl"
    make_pretrained("qwen2vl", folder, layers=2)
    config = qwen2vl.config(qwen2vl.SIZES["tiny"], 2, qwen2vl.SIZES["tiny"].vision_depth)
    assets.write_tokenizer_and_processor(folder, config)
    return folder


def _job(argv: list[str]):
    parser = main.__globals__["build_parser"]("run")
    return job_from_args(parser.parse_args(argv), parser)


def _exit(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_the_dataset_reaches_the_job_after_its_check(model_dir, capsys):
    data = DATA / "conversations.jsonl"
    job = _job(
        ["run", "qwen2vl", "--pretrained", str(model_dir), "--dataset", str(data), "--max-length", "200"]
    )
    assert job.model_options == {
        "pretrained": str(model_dir.resolve()),
        "dataset": str(data.resolve()),
        "image_root": None,
        "max_length": 200,
        "skip_bad_samples": False,
    }
    assert f"--dataset {data.resolve()}: 4 conversations" in capsys.readouterr().out


def test_truncate_cuts_what_max_length_refuses(model_dir, capsys):
    """``--truncate``: the samples above 100 tokens that ``--max-length 100`` refuses (naming the
    ways out) are cut instead, and the workers' example cuts them alike; it needs --max-length."""
    data = DATA / "conversations.jsonl"
    run = ["run", "qwen2vl", "--pretrained", str(model_dir), "--dataset", str(data)]
    err = _exit([*run, "--max-length", "100"], capsys)
    assert "conversations.jsonl:2: 112 tokens, above max_length 100" in err
    assert "--truncate" in err and "--skip-bad-samples" in err
    job = _job([*run, "--max-length", "100", "--truncate"])
    assert job.model_options["truncate"] is True
    assert f"--dataset {data.resolve()}: 4 conversations" in capsys.readouterr().out
    model = qwen2vl.build(2, pretrained=str(model_dir), dataset=str(data), max_length=100, truncate=True)
    assert "max_length 100 (longer cut)" in model.summary
    _, labels = model.batch(2, 1)  # sample 2 alone: its 107 tokens cut to 100
    assert labels.shape == (1, 100)
    assert "--truncate needs --max-length N" in _exit([*run, "--truncate"], capsys)


def test_bad_data_and_flags_exit_before_launching(model_dir, tmp_path, capsys):
    shutil.copytree(DATA / "imgs", tmp_path / "imgs")
    path = write_lines(
        tmp_path, chat("<image>Hi", "Yes.", ["imgs/red.png"]), chat("<image>Hi", "No.", ["imgs/x.png"])
    )
    run = ["run", "qwen2vl", "--pretrained", str(model_dir)]
    assert f"--dataset: {path}:2: image 0 {str(tmp_path / 'imgs/x.png')!r} does not exist" in _exit(
        [*run, "--dataset", str(path)], capsys
    )
    job = _job([*run, "--dataset", str(path), "--skip-bad-samples"])
    assert job.model_options["skip_bad_samples"] is True
    assert "1 conversations, 1 bad sample(s) skipped" in capsys.readouterr().out
    assert "--max-length, --skip-bad-samples need --dataset FILE" in _exit(
        [*run, "--max-length", "9", "--skip-bad-samples"], capsys
    )
    assert "--dataset needs --pretrained DIR" in _exit(["run", "qwen2vl", "--dataset", str(path)], capsys)
    assert "--dataset needs one of llama, qwen2vl, not embed_lm" in _exit(
        ["run", "embed_lm", "--dataset", str(path)], capsys
    )
    assert "is not a file" in _exit([*run, "--dataset", str(tmp_path / "none.jsonl")], capsys)
    assert "drop --image-sizes" in _exit([*run, "--dataset", str(path), "--image-sizes", "8x8"], capsys)
    assert "above max_length 20" in _exit([*run, "--dataset", str(path), "--max-length", "20"], capsys)
    config = json.loads((model_dir / "config.json").read_text())
    moved = tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    (moved / "config.json").write_text(json.dumps(config | {"vision_start_token_id": 3}))
    assert "<|vision_start|> is 126, config.json's vision_start_token_id is 3" in _exit(
        ["run", "qwen2vl", "--pretrained", str(moved), "--dataset", str(path)], capsys
    )


def test_the_example_trains_on_the_conversations(model_dir):
    """What the workers build for ``--dataset``: step k's batch is samples k·B.. of the file
    (wrapping), each prepared by the directory's processor, through ``vlm_batch``."""
    import graph_exec.models as gm
    from graph_exec.data import ConversationDataset

    data = DATA / "conversations.jsonl"
    model = qwen2vl.build(2, pretrained=str(model_dir), dataset=str(data))
    assert "conversations of" in model.summary and "4 samples, 0 skipped" in model.summary
    inputs, labels = model.batch(1, 3)  # samples 3, 0, 1
    samples = ConversationDataset(data, model_dir)
    want = gm.vlm_batch(
        model.split, [samples[3], samples[0], samples[1]], pad_token_id=samples.processor.pad_token_id
    )
    for mine, theirs in zip((*inputs, labels), (*want.inputs, want.labels), strict=True):
        np.testing.assert_array_equal(mine.asnumpy(), theirs)


def micro_losses(model, batches) -> tuple[list[float], list[int]]:
    """Each micro-batch's per-token loss and labelled tokens: the split's own cells run one after
    the other (the forward the workers run, without the pipeline: tests/runtime/test_packing.py
    checks the pipeline against the whole model)."""
    import graph_exec.models as gm
    from graph_exec.harness.training import _labelled

    losses, counts = [], []
    for inputs, labels in batches:
        hidden = model.preprocess(*inputs)
        for stage in model.stages:
            hidden = stage(*hidden) if isinstance(hidden, tuple) else stage(hidden)
        total, count = gm.causal_lm_token_loss(hidden, labels)
        losses.append(float(total.asnumpy()) / float(count.asnumpy()))
        counts.append(_labelled(labels))
    return losses, counts


def test_packing_and_no_packing_give_the_same_first_step_loss(model_dir, capsys):
    """``--packing`` reaches the example; the first step's loss of what the workers run with and
    without it (M = 2, the harness's per-token mean of the global batch: micro-batch losses
    weighted by their labelled tokens) is the same (atol 1e-5 / rtol 1e-4); the packed rows
    (200 tokens) hold less padding than the batch padded to its longest sample, and the step
    line prints the tower spread."""
    import mindspore as ms

    from graph_exec.cli.run import progress_text
    from graph_exec.harness.training import token_mean

    data = DATA / "conversations.jsonl"
    run = ["run", "qwen2vl", "--pretrained", str(model_dir), "--dataset", str(data)]
    job = _job([*run, "--max-length", "200", "--packing"])
    assert job.model_options["packing"] is True and job.model_options["max_length"] == 200
    assert "--packing needs --max-length N" in _exit([*run, "--packing"], capsys)
    step_losses, padding = [], []
    for packing in (False, True):
        model = qwen2vl.build(
            2, pretrained=str(model_dir), dataset=str(data), max_length=200, packing=packing
        )
        assert model.token_loss
        if packing:
            batches = model.micro_batches(0, 4, 2)
            # placed by the packed rows' tower work (rows x the fullest row's patches), whose
            # spread the step line prints
            costs = [model.tower_costs(inputs, 1)[0] for inputs, _ in batches]
            assert max(costs) / np.mean(costs) == pytest.approx(model.tower_spread(0, 4))
        else:
            inputs, labels = model.batch(0, 4)
            cut = [np.split(x.asnumpy(), 2) for x in (*inputs, labels)]
            batches = [(tuple(ms.Tensor(x[m]) for x in cut[:-1]), ms.Tensor(cut[-1][m])) for m in range(2)]
        step_losses.append(token_mean(*micro_losses(model, batches)))
        real, padded = model.token_counts(0, 4)
        padding.append(1 - real / padded)
    np.testing.assert_allclose(step_losses[1], step_losses[0], atol=1e-5, rtol=1e-4)
    assert padding[1] < padding[0]
    # --dp 2: each replica packs its half into its own ragged rows (none pads to the other's); the
    # step line's slots are both replicas' rows, and the global per-token mean the same
    assert _job([*run, "--max-length", "200", "--packing", "--ranks", "4", "--dp", "2"]).model_options[
        "packing"
    ]
    shards = [model.micro_batches(0, 4, 2, replica=r, replicas=2) for r in range(2)]
    assert model.token_counts(0, 4)[1] == 200 * sum(len(inputs[0]) for b in shards for inputs, _ in b)
    replica_losses = [micro_losses(model, b) for b in shards]
    replica_means = [token_mean(*lc) for lc in replica_losses]
    weights = [sum(counts) for _, counts in replica_losses]
    np.testing.assert_allclose(token_mean(replica_means, weights), step_losses[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"replica 2 of 2: the global batch of 4 samples must split"):
        model.micro_batches(0, 4, 2, replica=2, replicas=2)
    spread = model.tower_spread(0, 4)
    line = {"step": 0, "loss": step_losses[1], "seconds": 0.5, "tower_spread": spread}
    assert f"tower cost max/mean {spread:.2f}" in progress_text(line, 1)
