"""``graph-exec run qwen2vl --image-sizes / --images-per-sample`` without launching: the job
they describe (its model options, what the qwen2vl example builds from), and every bad value
exiting with code 2 and a message naming it before msrun starts."""

from __future__ import annotations

import pytest

from graph_exec.cli import build_parser, jobs, main
from graph_exec.cli.run import job_from_args
from graph_exec.report.job import JobSpec


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


def _job(argv: list[str]) -> JobSpec:
    parser = build_parser("run")
    return job_from_args(parser.parse_args(["run", *argv]), parser)


def test_the_flags_reach_the_job_and_survive_its_file(tmp_path) -> None:
    job = _job(["qwen2vl", "--image-sizes", "16x16,32x24,48x48", "--images-per-sample", "0-2"])
    assert job.model_options == {"image_sizes": [[16, 16], [32, 24], [48, 48]], "images_per_sample": [0, 2]}
    assert JobSpec.read(job.write(tmp_path)) == job
    one = _job(["qwen2vl", "--images-per-sample", "2", "--shapes", "dynamic"])
    assert one.model_options == {"image_sizes": [[16, 16]], "images_per_sample": [2, 2]}  # the preset's size
    assert one.shapes == "dynamic"
    assert _job(["qwen2vl"]).model_options is None  # one image of one grid per sample, as before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["qwen2vl", "--image-sizes", "16x12"],
            "--image-sizes 16x12: every size must be a multiple of patch x merge = 8",
        ),
        (["qwen2vl", "--image-sizes", "16x16,30x24"], "--image-sizes 30x24: every size must be a multiple"),
        (["qwen2vl", "--image-sizes", "16"], "invalid value '16': must be HxW sizes in pixels"),
        (["qwen2vl", "--image-sizes", "0x8"], "invalid value '0x8'"),
        (["qwen2vl", "--images-per-sample", "2-1"], "invalid value '2-1': must be LO-HI or N"),
        (["qwen2vl", "--images-per-sample", "-1"], "invalid value '-1'"),
        (["qwen2vl", "--images-per-sample", "0-9"], "--images-per-sample 0-9: at most 8 images per sample"),
        (["llama", "--images-per-sample", "0-2"], "need the qwen2vl example, not llama"),
        (
            ["qwen2vl", "--shapes", "buckets"],
            "need an example with a sequence length (embed_lm), not qwen2vl",
        ),
    ],
)
def test_bad_values_exit_2_naming_the_value(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
