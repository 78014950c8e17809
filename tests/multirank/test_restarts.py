"""``graph-exec run --max-restarts``: a killed rank costs a restart, not the job, and not a bit.

Every job is ``embed_lm`` (tiny, P=2, graph mode), 12 steps saving every 3, run in this process
through ``graph_exec.cli.main`` with the worker swapped for ``workers/restart_harness.py``: the
harness itself plus a kill hook (``GRAPH_EXEC_TEST_KILL``, read only there). The reference is
the same job uninterrupted, through the real harness. A restarted job must equal it bit for bit:
the loss of every step of every attempt (progress lines carry Python floats in full) and every
tensor of the final checkpoint (parameters and Adam state) on both ranks.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import graph_exec.launch as launch_module
from graph_exec.checkpoint import layout
from graph_exec.cli import jobs, main
from graph_exec.report.job import PROGRESS
from tests.multirank.conftest import WORKERS

pytestmark = pytest.mark.timeout(900)

STEPS = 12
#: The per-attempt wall-clock limit; the peer deadline is a third of it unless a test says.
TIMEOUT_S = 90
FLAGS = ["--ranks", "2", "--steps", str(STEPS), "--save-every", "3", "--no-pin", "--timeout", str(TIMEOUT_S)]


def run_argv(directory: Path) -> list[str]:
    """``graph-exec run embed_lm`` with the test's flags, checkpoints and logs in ``directory``."""
    return [
        "run",
        "embed_lm",
        *FLAGS,
        "--checkpoint-dir",
        str(directory / "ckpt"),
        "--log-dir",
        str(directory / "job"),
    ]


def graph_exec_run(capsys, directory: Path, *extra: str) -> tuple[int, str, str]:
    """``graph-exec run embed_lm`` in this process: (exit code, stdout, stderr)."""
    code = main([*run_argv(directory), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def losses(job_dir: Path) -> list[dict[int, float]]:
    """Per attempt, oldest first: ``{step: loss}`` from the last stage's progress lines."""
    logs = sorted((job_dir / "logs").glob("attempt_*/worker_1.log"), key=lambda p: int(p.parent.name[8:]))
    found = []
    for log in [*logs, job_dir / "logs" / "worker_1.log"]:
        lines = [
            json.loads(x[len(PROGRESS) :]) for x in log.read_text().splitlines() if x.startswith(PROGRESS)
        ]
        found.append({line["step"]: line["loss"] for line in lines if "step" in line})
    return found


def final_tensors(ckpt: Path) -> dict[int, dict[str, np.ndarray]]:
    import mindspore as ms

    folder = layout.step_dir(ckpt, STEPS)
    assert (folder / layout.MANIFEST).is_file(), f"no complete step {STEPS} in {ckpt}"
    return {
        rank: {
            name: value.asnumpy()
            for name, value in ms.load_checkpoint(str(folder / f"rank_{rank}.ckpt")).items()
        }
        for rank in (0, 1)
    }


def assert_equals_reference(reference: Path, restarted: Path) -> None:
    """Every step's loss in every attempt, and the final checkpoint, bit for bit."""
    (ref,) = losses(reference / "job")
    assert sorted(ref) == list(range(STEPS))
    seen = set()
    for attempt, per_step in enumerate(losses(restarted / "job")):
        for step, loss in per_step.items():
            assert loss == ref[step], (
                f"attempt {attempt} step {step + 1}: loss {loss!r}, uninterrupted {ref[step]!r}"
            )
        seen |= set(per_step)
    assert seen == set(range(STEPS))
    want, got = final_tensors(reference / "ckpt"), final_tensors(restarted / "ckpt")
    for rank in (0, 1):
        assert sorted(got[rank]) == sorted(want[rank])
        for name, value in want[rank].items():
            assert value.dtype == got[rank][name].dtype and value.tobytes() == got[rank][name].tobytes(), (
                rank,
                name,
            )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted job, through the real harness."""
    directory = tmp_path_factory.mktemp("reference")
    assert main(run_argv(directory)) == 0
    return directory


@pytest.fixture
def killing_worker(monkeypatch):
    """Launch ``restart_harness.py`` instead of the harness; ``kill("0:1:7")`` plans the deaths."""
    monkeypatch.setattr(jobs, "WORKER", WORKERS / "restart_harness.py")
    return lambda plan: monkeypatch.setenv("GRAPH_EXEC_TEST_KILL", plan)


def test_a_rank_killed_mid_run_costs_one_restart_and_no_bit(reference, killing_worker, tmp_path, capsys):
    killing_worker("0:1:7")  # attempt 0: rank 1 dies right before step 8 (checkpoint 6 is complete)
    code, out, err = graph_exec_run(capsys, tmp_path, "--max-restarts", "1")
    assert code == 0, out + err
    assert "graph-exec run: restarting, attempt 1 (restart 1 of at most 1), from checkpoint step 6" in err, (
        err
    )
    assert "attempt 0: rank 1 killed by signal 9 (SIGKILL) in step 8; started from step 0;" in err, err
    assert "attempts: 2" in out, out
    assert "  attempt 1: finished; resumed from checkpoint step 6;" in out, out
    line = next(x for x in out.splitlines() if x.startswith("  attempt 0: "))
    assert "1 step to redo; restarted (1 of 1)" in line, out
    assert (
        "TEST KILL: rank 1 attempt 0 before step 7"
        in (tmp_path / "job/logs/attempt_0/worker_1.log").read_text()
    )
    assert_equals_reference(reference, tmp_path)


def test_killed_twice_first_step_on_rank_0_then_while_saving(reference, killing_worker, tmp_path, capsys):
    # attempt 0: rank 0 dies at its first step (its peer is setting up and compiling); attempt 1:
    # rank 1 dies while saving step 9, leaving an incomplete step_9; attempt 2 resumes from 6.
    killing_worker("0:0:0,1:1:8:save")
    code, out, err = graph_exec_run(capsys, tmp_path, "--max-restarts", "2")
    assert code == 0, out + err
    assert "attempts: 3" in out, out
    lines = [x for x in out.splitlines() if x.startswith("  attempt ")]
    assert lines[0].startswith(
        "  attempt 0: rank 0 killed by signal 9 (SIGKILL) in step 1; started from step 0;"
    )
    assert "0 steps to redo; restarted (1 of 2)" in lines[0], out
    assert lines[1].startswith(
        "  attempt 1: rank 1 killed by signal 9 (SIGKILL) in step 9; started from step 0;"
    )
    assert "2 steps to redo; restarted (2 of 2)" in lines[1], out
    assert lines[2].startswith("  attempt 2: finished; resumed from checkpoint step 6;"), out
    assert_equals_reference(reference, tmp_path)


def test_killed_twice_with_one_restart_fails_naming_both_attempts(killing_worker, tmp_path, capsys):
    killing_worker("0:0:0,1:1:0")  # at the first step: rank 0 in attempt 0, rank 1 in attempt 1
    code, out, err = graph_exec_run(capsys, tmp_path, "--max-restarts", "1")
    assert code == 1, out + err
    assert "  attempt 0: rank 0 killed by signal 9 (SIGKILL) in step 1; started from step 0;" in err, err
    assert "  attempt 1: rank 1 killed by signal 9 (SIGKILL) in step 1; started from step 0;" in err, err
    assert "not retried: the restart limit (1) is reached" in err, err
    assert "rank 1: died, killed by signal 9 (SIGKILL)" in err, err


def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_one(reference, tmp_path, capsys):
    """The uninterrupted job's checkpoints (keep=2: steps 9 and 12) with step 12's rank 1 file
    corrupted: ``--resume`` skips step 12 (said once, set aside before the launch), resumes from
    step 9 and ends bit for bit where the uninterrupted job ended."""
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt")
    assert sorted(layout.step_dirs(tmp_path / "ckpt")) == [9, STEPS]
    rank_file = layout.step_dir(tmp_path / "ckpt", STEPS) / "rank_1.ckpt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    code, out, err = graph_exec_run(capsys, tmp_path, "--max-restarts", "2", "--resume")
    assert code == 0, out + err
    assert err.count(f"skipping corrupt checkpoint step {STEPS}") == 1, err
    assert "rank_1.ckpt does not match the checksum" in err and "set aside as" in err, err
    assert f"resuming from {layout.step_dir(tmp_path / 'ckpt', 9)}" in out, out
    assert "restarting" not in err, err
    (ref,) = losses(reference / "job")
    (resumed,) = losses(tmp_path / "job")
    assert sorted(resumed) == list(range(9, STEPS))
    assert all(resumed[step] == ref[step] for step in resumed), (resumed, ref)
    want, got = final_tensors(reference / "ckpt"), final_tensors(tmp_path / "ckpt")
    for rank in (0, 1):
        assert sorted(got[rank]) == sorted(want[rank])
        for name, value in want[rank].items():
            assert value.tobytes() == got[rank][name].tobytes(), (rank, name)
    assert (tmp_path / "ckpt" / f"step_{STEPS}.corrupt" / "rank_1.ckpt").is_file()


def test_nothing_usable_left_exits_2_before_launching(reference, tmp_path, capsys):
    """Only step 9 kept, and it is corrupt: exit 2 naming the file, nothing launched."""
    shutil.copytree(reference / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(layout.step_dir(tmp_path / "ckpt", STEPS))
    rank_file = layout.step_dir(tmp_path / "ckpt", 9) / "rank_1.ckpt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    with pytest.raises(SystemExit) as exc:
        graph_exec_run(capsys, tmp_path, "--resume")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--resume: no checkpoint in" in err and "rank_1.ckpt does not match" in err
    assert not (tmp_path / "job" / "logs").exists()  # msrun never started


#: The peer deadline of the hung-rank test, and how soon after the stop the job must relaunch.
PEER_TIMEOUT_S, RELAUNCHED_WITHIN_S = 20, 30


@pytest.mark.parametrize("hung", [0, 1])
def test_a_stopped_rank_is_named_hung_and_the_job_restarts_within_30_s(
    hung, reference, killing_worker, tmp_path, capsys, monkeypatch
):
    """Rank ``hung`` stops (SIGSTOP) right before step 8: its peer times out waiting for it after
    the peer deadline, the record names the stopped rank as hung (not as killed by msrun's or the
    launcher's signals), and the relaunch from checkpoint 6 finishes bit-identical."""
    launched = []
    once = launch_module._launch_once
    monkeypatch.setattr(launch_module, "_launch_once", lambda *a: launched.append(time.time()) or once(*a))
    killing_worker(f"0:{hung}:7:stop")
    code, out, err = graph_exec_run(
        capsys, tmp_path, "--max-restarts", "1", "--peer-timeout", str(PEER_TIMEOUT_S)
    )
    assert code == 0, out + err
    waiting = 1 - hung
    line = next(x for x in out.splitlines() if x.startswith("  attempt 0: "))
    assert line.startswith(f"  attempt 0: rank {hung} hung: rank {waiting} timed out waiting for it ("), out
    assert f"[waiting for global rank {hung}]" in line and "in step 8; started from step 0;" in line, out
    assert "1 step to redo; restarted (1 of 1)" in line, out
    assert "  attempt 1: finished; resumed from checkpoint step 6;" in out, out
    stop_log = (tmp_path / f"job/logs/attempt_0/worker_{hung}.log").read_text()
    stopped = re.search(rf"TEST STOP: rank {hung} attempt 0 before step 7 at ([\d.]+)", stop_log)
    assert stopped is not None, stop_log
    assert len(launched) == 2
    assert launched[1] - float(stopped.group(1)) < RELAUNCHED_WITHIN_S, (launched, stopped.group(1))
    assert_equals_reference(reference, tmp_path)
