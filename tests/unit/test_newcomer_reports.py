"""Failure reports, progress words and fast argument handling (issue #12), without launching."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graph_exec.cli.jobs import last_finished_step
from graph_exec.cli.status import StatusPrinter
from graph_exec.launch_report import exit_words, failure_report, own_error, worker_exits
from graph_exec.report.job import PROGRESS

MSRUN_OUT = """Start worker process with rank id:1, log file:/x/worker_1.log.
[ERROR] ME(1:2,MainProcess):2026 [mindspore/parallel/cluster/process_entity/_api.py:365] Worker process 4242 exit with exception. Error code: -9.
[ERROR] ME(1:2,MainProcess):2026 [..._api.py:365] Worker process 999 exit with exception. Error code: 1.
RuntimeError: Distributed job exited with exception."""


def test_msrun_worker_exits_are_mapped_to_ranks():
    assert worker_exits(MSRUN_OUT, {4242: 1, 4241: 0}) == {1: -9}
    assert worker_exits(MSRUN_OUT, {999: 0, 4242: 1}) == {0: 1, 1: -9}


@pytest.mark.parametrize(
    ("code", "words"),
    [(-9, "killed by signal 9 (SIGKILL)"), (-15, "killed by signal 15 (SIGTERM)"), (3, "exited with code 3")],
)
def test_exit_words(code, words):
    assert exit_words(code) == words


def test_own_error_is_the_last_exception_line():
    log = "step 1\nTraceback (most recent call last):\n  File x\ngraph_exec.errors.PeerTimeoutError: rank 1 sent nothing for 100 s (waiting in F1.2)\n"
    assert (
        own_error(log)
        == "graph_exec.errors.PeerTimeoutError: rank 1 sent nothing for 100 s (waiting in F1.2)"
    )
    assert own_error("all fine\nstep 2 loss 1.0\n") is None


def test_report_names_dead_rank_survivor_error_and_fills_tails():
    logs = {
        0: "@@graph-exec x\nTraceback (most recent call last):\nPipelineStepError: rank 1 failed at step B1.0\n",
        1: "",
    }
    text = failure_report(
        headline="msrun exit code 1 after 30.0 s",
        worker_logs=logs,
        exits={1: -9},
        msrun_output=MSRUN_OUT,
        tail_lines=40,
        last_step=lambda log: "last finished step 3" if log else "no step finished",
    )
    lines = text.splitlines()
    assert lines[0] == "msrun exit code 1 after 30.0 s"
    assert lines[1] == (
        "rank 0: stopped after the failure above; last finished step 3; "
        "its error: PipelineStepError: rank 1 failed at step B1.0"
    )
    assert lines[2] == "rank 1: died, killed by signal 9 (SIGKILL); no step finished"
    assert "----- worker 0 (last 2 of 2 lines) -----" in lines
    assert "(nothing else: no error, no traceback)" in lines  # rank 1's empty log says so
    assert not any(line.startswith("@@graph-exec") for line in lines)


def test_last_finished_step_reads_progress_lines():
    log = "\n".join(
        PROGRESS + json.dumps({"run": "run", "step": k, "loss": None, "seconds": 1}) for k in range(3)
    )
    assert last_finished_step(log) == "last finished step 3 (run run)"
    assert last_finished_step("").startswith("no step finished")


def test_status_lines_in_words():
    out: list[str] = []
    status = StatusPrinter(2, out.append)
    status({"phase": "started"})
    status({"phase": "compiling", "graphs": 1, "seconds": 2.04, "elapsed": 3})
    status({"phase": "compiling", "graphs": 6, "seconds": 9.5, "elapsed": 12})
    status({"phase": "finishing"})
    assert out[0].startswith("starting 2 ranks with msrun")
    assert out[1].startswith("ranks connected after ")
    assert out[2:] == [
        "compiling... 1 graph, 2.0 s so far (last rank)",
        "compiling... 6 graphs, 9.5 s so far (last rank)",
        "training done; ranks are writing their records and exiting...",
    ]


@pytest.mark.parametrize(
    "argv",
    [["run", "--help"], ["bench", "--help"], ["run", "embed_lm", "--micro", "4", "--batch", "6"],
     ["run", "vl_tower", "--backward", "owner"], ["bench", "--variants", "nope"]],
)  # fmt: skip
def test_help_and_argument_errors_do_not_import_mindspore(argv):
    probe = (
        "import sys\nfrom graph_exec.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print('CODE', code, 'MINDSPORE', 'mindspore' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    expected = 0 if "--help" in argv else 2
    assert f"CODE {expected} MINDSPORE False" in done.stdout, done.stdout + done.stderr


def test_trainable_defaults_known_without_import_match_the_examples():
    from graph_exec.examples import EXAMPLES, TRAINABLE_BY_DEFAULT, load

    assert set(TRAINABLE_BY_DEFAULT) == set(EXAMPLES)
    for name, trainable in TRAINABLE_BY_DEFAULT.items():
        assert load(name).trainable_by_default is trainable, name


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("", "GLOG_v=3 python_level=None"),  # unset, MindSpore not loaded yet: C++ and Python quiet
        ("os.environ['GLOG_v'] = '1'", "GLOG_v=1 python_level=None"),  # the user's choice is kept
        ("VERBOSE", "GLOG_v=None python_level=None"),  # verbose=True: nothing changes
        ("import mindspore", "GLOG_v=3 python_level=40"),  # loaded already: Python logger to ERROR
    ],
)
def test_quiet_logs(setup, expected):
    probe = (
        "import os, sys\nos.environ.pop('GLOG_v', None)\n"
        + (setup if setup != "VERBOSE" else "")
        + "\nfrom graph_exec.msenv import quiet_logs\n"
        + f"quiet_logs(verbose={setup == 'VERBOSE'})\n"
        + "level = None\nif 'mindspore' in sys.modules:\n"
        + "    from mindspore import log\n    level = log._get_logger().level\n"
        + "print(f\"GLOG_v={os.environ.get('GLOG_v')} python_level={level}\")\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == expected, done.stdout + done.stderr
