"""``graph-exec run --seq-len-range / --shapes / --shape-buckets`` without launching: the job
they describe, and every impossible set exiting with code 2 before msrun starts."""

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
    job = _job(["embed_lm", "--seq-len-range", "16,256", "--shapes", "buckets"])
    assert job.seq_len_range == (16, 256)
    assert job.shapes == "buckets" and job.shape_buckets == (64, 128, 192, 256)  # 4 even steps
    assert JobSpec.read(job.write(tmp_path)) == job
    explicit = _job(
        ["embed_lm", "--seq-len-range", "8,40", "--shapes", "buckets", "--shape-buckets", "16,48"]
    )
    assert explicit.shape_buckets == (16, 48)
    plain = _job(["embed_lm"])
    assert (plain.seq_len_range, plain.shapes, plain.shape_buckets) == (None, "static", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["embed_lm", "--seq-len-range", "9,3"],
            "invalid value '9,3': must be MIN,MAX: two ints with 1 <= MIN <= MAX",
        ),
        (["embed_lm", "--seq-len-range", "16"], "invalid value '16'"),
        (["embed_lm", "--shapes", "jit"], "argument --shapes: invalid choice: 'jit'"),
        (
            ["embed_lm", "--shapes", "dynamic", "--shape-buckets", "64"],
            "--shape-buckets needs --shapes buckets",
        ),
        (
            ["embed_lm", "--shapes", "buckets", "--shape-buckets", "64,32"],
            "must be strictly increasing positive ints",
        ),
        (["embed_lm", "--shape-buckets", "64"], "--shape-buckets needs --shapes buckets"),
        (
            ["embed_lm", "--seq-len-range", "16,300", "--shapes", "buckets", "--shape-buckets", "64,256"],
            "the longest sequence (300) is above the largest of --shape-buckets (64, 256)",
        ),
        (
            ["vl_tower", "--shapes", "buckets"],
            "need an example with a sequence length (embed_lm), not vl_tower",
        ),
    ],
)
def test_impossible_sets_exit_2_naming_the_value(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
