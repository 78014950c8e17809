"""``graph-exec run --pretrained/--export/--steps 0`` without launching: what reaches the job,
and the flags that cannot work exiting with code 2 before msrun starts."""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


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
