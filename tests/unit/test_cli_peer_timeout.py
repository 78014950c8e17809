"""``--peer-timeout``: how long a rank of ``graph-exec run``/``bench`` waits for another before
it names it (the job's ``timeout_s``, every wait for a peer inside a step), and its default."""

from __future__ import annotations

import pytest

from graph_exec.cli import main
from graph_exec.cli.bench import job_from_args as bench_job
from graph_exec.cli.run import job_from_args as run_job


def job(argv: list[str]):
    parser = main.__globals__["build_parser"](argv[0])
    args = parser.parse_args(argv)
    return (run_job if argv[0] == "run" else bench_job)(args, parser)


@pytest.mark.parametrize(
    ("argv", "deadline"),
    [
        (["run", "embed_lm"], 60.0),  # --timeout 300: capped at 60 s
        (["run", "embed_lm", "--timeout", "90"], 30.0),  # a third of the job's limit
        (["run", "embed_lm", "--peer-timeout", "20"], 20.0),
        (["run", "embed_lm", "--timeout", "60", "--peer-timeout", "59.5"], 59.5),
        (["bench"], 60.0),  # --timeout 1200
        (["bench", "--peer-timeout", "200"], 200.0),
    ],
)
def test_the_peer_deadline_is_well_under_the_jobs_limit(argv, deadline):
    assert job(argv).timeout_s == deadline


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "embed_lm", "--peer-timeout", "0"], "argument --peer-timeout: invalid value '0'"),
        (["run", "embed_lm", "--peer-timeout", "nan"], "argument --peer-timeout: invalid value 'nan'"),
        (
            ["run", "embed_lm", "--timeout", "60", "--peer-timeout", "60"],
            "--peer-timeout 60 must be below --timeout 60",
        ),
        (
            ["bench", "--timeout", "100", "--peer-timeout", "120"],
            "--peer-timeout 120 must be below --timeout 100",
        ),
    ],
)
def test_a_peer_deadline_that_cannot_fire_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
