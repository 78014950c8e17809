"""Checkpoint and resume on 2 ranks under msrun (worker: ``workers/checkpoint_checks.py``).

Two launches: the first trains, saves and resumes in the same job for every set-up, then has
rank 1 killed while saving step 6; the second is a new job that resumes from those files and
runs the fault cases. Exact resume is compared at atol 1e-6 against uninterrupted training.
"""

from __future__ import annotations

import json
import shutil

import pytest

import graph_exec as ge
from graph_exec.checkpoint.layout import MANIFEST
from tests.multirank.conftest import checks
from tests.multirank.workers.checkpoint_checks import CASES

pytestmark = pytest.mark.timeout(1500)


def failed_lines(result, rank):
    return [
        line
        for line in result.worker_logs.get(rank, "").splitlines()
        if line.startswith("CHECK") and " FAIL" in line
    ]


def save_world1_checkpoint(directory):
    """A checkpoint of the same model written by a one-process job (world size 1)."""
    from mindspore import nn

    from tests.multirank.workers.checkpoint_checks import MICRO, build, loss_fn

    model = build(4, "trainable")
    stages = [ge.PipelineStage(cell, k, 4) for k, cell in enumerate(model.stages)]
    sched = ge.ScheduleMPipeTranspose(stages, MICRO, model.preprocess, 1, loss_fn=loss_fn)
    ge.save_checkpoint(sched, directory, 3, optimizer=nn.Adam(sched.trainable_params()))


def test_resume_is_exact_and_faults_are_reported(run_workers, tmp_path):
    root = tmp_path / "ckpt"
    first = run_workers(
        "checkpoint_checks.py", 2, "train", str(root), timeout_s=900, expect_ok=False, env={"KILL_RANK": "1"}
    )
    shutil.copytree(first.log_dir, tmp_path / "logs_train")  # the second launch reuses the log directory
    for rank in (0, 1):
        assert not failed_lines(first, rank), first.describe()
        assert "train_phase_done" in checks(first, rank), first.describe()
        for case in CASES:
            assert f"{case.name}.same_job.params" in checks(first, rank), first.describe()
    assert "KILLING rank 1 while saving" in first.worker_logs[1]
    assert all(f"{case.name}.same_job.losses" in checks(first, 1) for case in CASES)
    # The killed save left debris, never a complete step 6.
    killed = root / "killed"
    assert (killed / "step_6").is_dir() and not (killed / "step_6" / MANIFEST).exists()
    with pytest.warns(UserWarning, match="incomplete checkpoint step 6"):
        assert ge.latest_checkpoint(killed) == 3
    manifest = json.loads((root / CASES[0].name / "step_3" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and manifest["mesh"] == {"dp": 1, "pp": 2}
    assert manifest["stage_ranks"] == {"0": [0], "1": [1], "2": [0], "3": [1]}
    assert [entry["stages"] for entry in manifest["ranks"]] == [[0, 2], [1, 3]]

    save_world1_checkpoint(root / "world1")
    second = run_workers("checkpoint_checks.py", 2, "resume", str(root), timeout_s=900)
    expected = {
        "killed.loads_step_3",
        "corrupted.explicit_step_is_reported_on_every_rank",
        "corrupted.falls_back_to_step_2",
        "corrupted.says_so",
        "corrupted.set_aside",
        "own_disks.refused_on_every_rank",
        "own_disks.never_complete",
        "rng.restored_per_rank",
        "missing.falls_back_to_step_2",
        "missing.explicit_step_is_incomplete",
        "other_vpp",
        "other_preprocess",
        "other_world_size",
        "save_twice",
        "failed_save.reported_on_every_rank",
        "failed_save.previous_stays_latest",
    }
    for rank in (0, 1):
        assert "ALL DONE failures=0" in second.worker_logs[rank], second.describe()
        assert expected <= checks(second, rank), second.describe()
        assert all(f"{case.name}.new_job.params" in checks(second, rank) for case in CASES)
    assert all(f"{case.name}.new_job.losses" in checks(second, 1) for case in CASES)


def graph_exec_run(*args: str) -> str:
    """``graph-exec run`` as a user runs it; its output (fails the test on a non-zero exit)."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "graph_exec.cli", "run", "embed_lm", "--ranks", "2", *args]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=400, env={**os.environ, "GLOG_v": "3"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cli_resume_continues_the_uninterrupted_run(tmp_path):
    """Run 6 steps saving every 3; then resume a copy without step 6 from step 3: the resumed
    steps' losses (per-rank records, full precision) equal the uninterrupted run's."""
    from graph_exec.report.records import read_run

    whole = graph_exec_run(
        "--steps",
        "6",
        "--save-every",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "a"),
        "--log-dir",
        str(tmp_path / "log_a"),
    )
    saved = [line for line in whole.splitlines() if "checkpoint written to" in line]
    assert [line.split()[1] for line in saved] == ["3/6", "6/6"], whole
    assert all(" ms (" in line and "MiB, all ranks)" in line for line in saved)
    assert ge.latest_checkpoint(tmp_path / "a") == 6
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "step_6")
    resumed = graph_exec_run(
        "--steps",
        "6",
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--resume",
        "--log-dir",
        str(tmp_path / "log_b"),
    )
    assert "resuming from" in resumed and "resumed from checkpoint step 3 (loaded in" in resumed, resumed
    steps = [line.split()[1] for line in resumed.splitlines() if line.startswith("step ")]
    assert steps == ["4/6", "5/6", "6/6"], resumed
    losses = {}
    for name in ("log_a", "log_b"):
        (last,) = [r for r in read_run(tmp_path / name, "run", 2) if r.rank == 1]
        losses[name] = {s.step: s.loss for s in last.steps}
    assert sorted(losses["log_b"]) == [3, 4, 5]
    for step, loss in losses["log_b"].items():
        assert abs(loss - losses["log_a"][step]) <= 1e-6, (step, loss, losses["log_a"][step])
    assert ge.latest_checkpoint(tmp_path / "b") == 6
