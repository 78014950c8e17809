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
    code, out, _ = _run([*PLAN, "--preprocess", "trainable", "--run-ahead", "min", "--owned-input"], capsys)
    assert code == 0
    assert out.splitlines()[1] == (
        "r1: BCAST TFWD1 OUTsend1 INsend1 Frecv1.0 F1.0 Frecv1.1 B1.0 Bsend1.0 F1.1 Frecv1.2 B1.1 "
        "Bsend1.1 F1.2 Frecv1.3 B1.2 Bsend1.2 F1.3 B1.3 Bsend1.3"
    )


def test_run_ahead_is_the_new_name_of_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    plans = [
        _run([*PLAN, "--preprocess", "trainable", flag, "min", "--owned-input"], capsys)[1]
        for flag in ("--overflow", "--run-ahead")
    ]
    assert plans[0] == plans[1] and "TFWD1 OUTsend1" in plans[0]
    assert plans[0] != _run([*PLAN, "--preprocess", "trainable", "--owned-input"], capsys)[1]


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
            "argument --run-ahead/--overflow: invalid choice: 'half'",
        ),
        ([*PLAN, "--preprocess", "none", "--backward", "x"], "argument --backward: invalid choice: 'x'"),
        ([*PLAN, "--preprocess", "none", "--body", "zbv"], "argument --body: invalid choice: 'zbv'"),
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
            ["plan", "--vpp", "2", "--micro", "4"],
            "the following arguments are required: --pp",
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
    # The error and where the help is, not argparse's usage block.
    assert err.startswith("graph-exec") and err.endswith("--help\n") and len(err.splitlines()) == 2
    assert "usage:" not in err
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
        # 1F1B holds P - r micro-batches' activations on rank r
        "predicted peak held per rank (items at once; bytes: the peak of their sum):",
        "rank 0: activations 2, receives 2, preprocess outputs 1",
        "rank 1: activations 1, receives 1, preprocess outputs 1",
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


def test_plan_body_zb_in_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    base = [*PLAN, "--preprocess", "trainable", "--body", "zb"]
    code, text, _ = _run(base, capsys)
    assert code == 0
    assert "I0.0 TBWD0 W0.0" in text.splitlines()[0]  # the preprocess backward follows stage 0's I
    _, doc, _ = _run([*base, "--format", "json", "--json-steps"], capsys)
    plan = json.loads(doc)
    assert plan["config"]["body"] == "zb"
    assert {"I", "W"} <= {step["kind"] for step in plan["ranks"][1]["steps"]}
    assert plan["ranks"][1]["held"]["output gradients"] == 2
    _, table, _ = _run([*base, "--format", "csv"], capsys)
    assert "1I0" in table and "1W0" in table and "TBWD" not in table


def test_simulate_body_zb_with_i_and_w_times(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--pp", "4", "--vpp", "1", "--micro", "8", "--preprocess", "none"]
    _, one_f_one_b, _ = _run([*argv, "--body", "1f1b", "--bwd-time", "2"], capsys)
    _, zb, _ = _run([*argv, "--body", "zb", "--bwd-time", "2", "--i-time", "1", "--w-time", "1"], capsys)
    assert one_f_one_b.splitlines()[0] == "step time: 33"
    assert zb.splitlines()[0] == "step time: 27"
    _, halves, _ = _run([*argv, "--body", "zb", "--bwd-time", "2"], capsys)  # I = W = B/2 by default
    assert halves.splitlines()[0] == "step time: 27"
    code, _, err = _run([*argv, "--body", "zb", "--i-time", "-1"], capsys)
    assert code == 2 and "--i-time" in err


def test_plan_flags_default_to_what_plan_config_defaults_to(capsys: pytest.CaptureFixture[str]) -> None:
    from graph_exec.cli import build_parser
    from graph_exec.cli.plan import config_from_args
    from graph_exec.schedule import PlanConfig

    parser = build_parser("plan")
    assert config_from_args(parser.parse_args(["plan", "--pp", "3"]), parser) == PlanConfig(pp=3)
    code, short, _ = _run(["plan", "--pp", "2"], capsys)
    assert code == 0
    assert (
        short == _run(["plan", "--pp", "2", "--vpp", "1", "--micro", "2", "--preprocess", "none"], capsys)[1]
    )


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
