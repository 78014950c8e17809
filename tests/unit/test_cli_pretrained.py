"""``graph-exec run --pretrained/--export/--steps 0`` without launching: what reaches the job,
and the flags that cannot work exiting with code 2 before msrun starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from graph_exec.cli import jobs, main
from graph_exec.cli.run import job_from_args


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


def _job(argv: list[str]):
    parser = main.__globals__["build_parser"]("run")
    return job_from_args(parser.parse_args(argv), parser)


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def hub_directory(folder: Path, dtype: str = "BF16", model_type: str = "llama") -> Path:
    """A two-shard directory as the Hub lays one out (headers only matter before the launch)."""
    from graph_exec.hub.dtypes import write_safetensors

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "torch_dtype": "bfloat16"}))
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for file, name in shards.items():
        bits = np.zeros((2, 2), np.uint8 if dtype == "F8_E4M3" else np.uint16)
        write_safetensors(folder / file, {name: (dtype, bits)}, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: file for file, name in shards.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return hub_directory(tmp_path / "llama")


def test_pretrained_and_export_reach_the_job(directory: Path, tmp_path: Path) -> None:
    job = _job(["run", "llama", "--pretrained", str(directory), "--export", str(tmp_path / "out")])
    assert job.model_options == {"pretrained": str(directory.resolve())}
    assert job.export_dir == str((tmp_path / "out").resolve()) and not job.export_overwrite
    assert (job.warmup, job.steps) == (1, 7)
    round_trip = _job(
        ["run", "llama", "--pretrained", str(directory), "--steps", "0", "--export", str(tmp_path / "o")]
    )
    assert (round_trip.warmup, round_trip.steps, round_trip.total_steps) == (0, 0, 0)
    assert _job(["run", "llama"]).export_dir is None and _job(["run", "llama"]).model_options is None


def test_flags_that_cannot_work_exit_before_launching(directory, tmp_path, capsys) -> None:
    assert "--steps 0 trains nothing: it needs --export DIR" in _exit(
        ["run", "llama", "--steps", "0"], capsys
    )
    assert "is not a pretrained directory: it has no config.json" in _exit(
        ["run", "llama", "--pretrained", str(tmp_path)], capsys
    )
    assert "need one of llama, qwen2vl, not embed_lm" in _exit(
        ["run", "embed_lm", "--pretrained", str(directory)], capsys
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert "exists and is not empty: choose another directory or pass --overwrite" in _exit(
        ["run", "llama", "--export", str(full)], capsys
    )
    job = _job(["run", "llama", "--export", str(full), "--overwrite"])
    assert job.export_overwrite
    assert "--export-dtype needs --export DIR" in _exit(
        ["run", "llama", "--pretrained", str(directory), "--export-dtype", "float32"], capsys
    )
    assert _job(
        ["run", "llama", "--export", str(full), "--overwrite", "--export-dtype", "float16"]
    ).export_dtype == ("float16")


def test_a_bad_directory_is_refused_before_the_launch(tmp_path: Path, capsys) -> None:
    """What can be checked without MindSpore is, with the one line that says what is wrong."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    err = _exit(["run", "llama", "--pretrained", str(empty)], capsys)
    assert "names no model_type; the models known: llama, qwen2" in err
    assert err.endswith("see graph-exec run --help\n") and "usage:" not in err
    vision = hub_directory(tmp_path / "vl", model_type="qwen2_vl")
    assert "holds model_type 'qwen2_vl'; the models known: llama, qwen2" in _exit(
        ["run", "llama", "--pretrained", str(vision)], capsys
    )
    missing = hub_directory(tmp_path / "missing")
    (missing / "model-00002-of-00002.safetensors").unlink()
    assert "missing shard(s) ['model-00002-of-00002.safetensors']" in _exit(
        ["run", "llama", "--pretrained", str(missing)], capsys
    )
    cut = hub_directory(tmp_path / "cut")
    shard = cut / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    assert "model-00001-of-00002.safetensors' is not a safetensors file safetensors can read" in _exit(
        ["run", "llama", "--pretrained", str(cut)], capsys
    )
    fp8 = hub_directory(tmp_path / "fp8", dtype="F8_E4M3")
    assert "tensor 'a' is stored as F8_E4M3, which cannot be read; readable: F64, F32, F16, BF16" in _exit(
        ["run", "llama", "--pretrained", str(fp8)], capsys
    )


def test_size_with_pretrained_is_said_to_size_nothing(directory: Path, capsys) -> None:
    _job(["run", "llama", "--pretrained", str(directory), "--size", "small", "--steps", "1"])
    err = capsys.readouterr().err
    assert "--size small does not size the model with --pretrained (its config.json does)" in err
    _job(["run", "llama", "--pretrained", str(directory), "--steps", "1"])
    assert capsys.readouterr().err == ""


def test_export_arguments_that_cannot_work_exit_2(directory: Path, tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path / "out")]
    assert "is not a directory" in _exit(
        ["export", str(tmp_path / "none"), "--config-from", str(directory), *out], capsys
    )
    assert "has no config.json" in _exit(
        ["export", str(tmp_path), "--config-from", str(tmp_path), *out], capsys
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    argv = ["export", str(tmp_path), "--config-from", str(directory), "--out", str(full)]
    assert "exists and is not empty" in _exit(argv, capsys)
