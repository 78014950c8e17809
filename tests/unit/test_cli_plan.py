"""``graph-exec plan`` and ``graph-exec simulate``: outputs, and bad input as clean argparse errors."""

from __future__ import annotations

import csv
import io
import json
import time

import pytest

from graph_exec.cli import main

PLAN = ["plan", "--pp", "2", "--vpp", "1", "--micro", "4"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_text_is_the_contract_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run([*PLAN, "--preprocess", "trainable", "--overflow", "min", "--owned-input"], capsys)
    assert code == 0
    assert out.splitlines()[1] == (
        "r1: BCAST TFWD1 OUTsend1 INsend1 Frecv1.0 F1.0 Frecv1.1 B1.0 Bsend1.0 F1.1 Frecv1.2 B1.1 "
        "Bsend1.1 F1.2 Frecv1.3 B1.2 Bsend1.2 F1.3 B1.3 Bsend1.3"
    )


def test_plan_formats(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--pp", "2", "--vpp", "2", "--micro", "4", "--preprocess", "frozen", "--body", "gpipe"]
    _, text, _ = _run([*base, "--with-idle"], capsys)
    assert len(text.splitlines()) == 2 and "·" in text
    _, doc, _ = _run([*base, "--format", "json"], capsys)
    assert json.loads(doc)["config"]["body"] == "gpipe"
    _, table, _ = _run([*base, "--format", "csv"], capsys)
    assert next(csv.reader(io.StringIO(table)))[0] == "0F0"
    _, owner, _ = _run([*PLAN, "--preprocess", "trainable", "--backward", "owner", "-T", "2"], capsys)
    assert owner.splitlines()[0].endswith("GRADsend1 GRADsend3 GRADreduce")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--pp", "0", "--vpp", "1", "--micro", "4", "--preprocess", "none"],
            "argument --pp: invalid value '0': must be a positive int",
        ),
        (
            ["plan", "--pp", "2", "--vpp", "x", "--micro", "4", "--preprocess", "none"],
            "argument --vpp: invalid value 'x': must be a positive int",
        ),
        (
            ["plan", "--pp", "2", "--vpp", "1", "--micro", "-3", "--preprocess", "none"],
            "argument --micro: invalid value '-3': must be a positive int",
        ),
        (
            [*PLAN, "--preprocess", "trainable", "-T", "-1"],
            "argument -T/--num-preprocess-layers: invalid value '-1'",
        ),
        ([*PLAN, "--preprocess", "trainable", "-T", "1.5"], "invalid value '1.5': must be an int >= 0"),
        ([*PLAN, "--preprocess", "bogus"], "argument --preprocess: invalid choice: 'bogus'"),
        (
            [*PLAN, "--preprocess", "none", "--overflow", "half"],
            "argument --overflow: invalid choice: 'half'",
        ),
        ([*PLAN, "--preprocess", "none", "--backward", "x"], "argument --backward: invalid choice: 'x'"),
        ([*PLAN, "--preprocess", "none", "--body", "zb"], "argument --body: invalid choice: 'zb'"),
        (
            [*PLAN, "--preprocess", "frozen", "--backward", "owner"],
            "backward 'owner' needs preprocess 'trainable'",
        ),
        ([*PLAN, "--preprocess", "none", "-T", "3"], "preprocess 'none' is dataload only (T=0)"),
        (
            [*PLAN, "--preprocess", "frozen", "-T", "0"],
            "preprocess 'frozen' needs num_preprocess_layers >= 1",
        ),
        (
            ["plan", "--pp", "1", "--vpp", "1", "--micro", "4", "--preprocess", "trainable", "--owned-input"],
            "input 'owned' needs a peer rank, but pp=1: with pp=1 rank 0 holds every micro-batch",
        ),
        (
            ["plan", "--pp", "2", "--vpp", "2", "--micro", "4", "--preprocess", "none", "--body", "1f1b"],
            "body '1f1b' is the non-interleaved schedule and needs vpp=1",
        ),
        (
            [*PLAN, "--preprocess", "none", "--format", "json", "--with-idle"],
            "--with-idle applies to --format text only",
        ),
        (
            ["plan", "--pp", "2", "--micro", "4", "--preprocess", "none"],
            "the following arguments are required: --vpp",
        ),
        (
            ["simulate", *PLAN[1:], "--preprocess", "none", "--fwd-time", "-1"],
            "argument --fwd-time: invalid value '-1'",
        ),
        (["simulate", *PLAN[1:], "--preprocess", "none", "--latency", "nan"], "must be a finite number >= 0"),
        (
            ["simulate", *PLAN[1:], "--preprocess", "none", "--bandwidth", "0"],
            "argument --bandwidth: invalid value '0'",
        ),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert out == ""
    assert message in err
    assert err.startswith("usage: graph-exec")
    assert "Traceback" not in err


def test_simulate_reports_and_writes_a_trace(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    argv = [
        "simulate",
        "--pp",
        "2",
        "--vpp",
        "1",
        "--micro",
        "2",
        "--preprocess",
        "frozen",
        "--fwd-time",
        "1",
        "--bwd-time",
        "1",
        "--pre-fwd-time",
        "2",
        "--trace",
        str(trace),
    ]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    assert out.splitlines() == [
        "step time: 8",
        "bubble fraction: 0.2500",
        "rank 0: busy 6 idle 2",
        "rank 1: busy 6 idle 2",
        "fair baseline (no transposition): step time 10",
        "MPipe saving: 2 (20.0% of the fair baseline's step)",
        f"trace written to {trace}",
    ]
    assert {e["tid"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_simulate_body_only_has_no_saving_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        ["simulate", "--pp", "4", "--vpp", "2", "--micro", "8", "--preprocess", "none"], capsys
    )
    assert code == 0
    # 8*2*(1+2) + 3*(1+2) = 57 with the default costs (forward 1, backward 2 per chunk)
    assert out.splitlines()[0] == "step time: 57"
    assert "MPipe" not in out


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_plan_too_large_for_the_machine_exits_2_before_building(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 39.3: this command ran 147 s and took all 24 GB until the OOM killer fired.
    argv = [command, "--pp", "2", "--vpp", "1", "--micro", "100000000", "--preprocess", "trainable"]
    start = time.perf_counter()
    code, out, err = _run(argv, capsys)
    assert time.perf_counter() - start < 1.0
    assert code == 2 and out == ""
    verb = "building" if command == "plan" else "simulating"
    assert f"pp=2, vpp=1, micro=100000000: {verb} the plan would take about" in err
    assert "Use fewer micro-batches" in err
