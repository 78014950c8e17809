"""``graph-exec run --data shuffled``: a restarted job reads exactly the batches an uninterrupted
one reads, and data-parallel replicas read every sample once per epoch.

The jobs are ``embed_lm`` (tiny, graph mode) reading a fixed set of 3 global batches of the
example's samples through ``graph_exec.data.DataLoader`` (shuffled by seed and epoch, each
replica its shard), launched in this process through ``graph_exec.cli.main``. Every rank's
progress line of a step names the source indices of its replica's batch (``samples``). The
kill hook is ``tests/multirank/test_restarts.py``'s (``workers/restart_harness.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graph_exec.cli import jobs, main
from graph_exec.report.job import PROGRESS
from tests.multirank.conftest import WORKERS

pytestmark = pytest.mark.timeout(900)

STEPS = 8
#: ``graph_exec.harness.training.EPOCH_STEPS`` global batches of ``BATCH`` samples.
EPOCH_STEPS, BATCH = 3, 8
FLAGS = ["--steps", str(STEPS), "--batch", str(BATCH), "--data", "shuffled", "--no-pin", "--timeout", "400"]


def run_argv(directory: Path, *extra: str) -> list[str]:
    return [
        "run",
        "embed_lm",
        *FLAGS,
        "--checkpoint-dir",
        str(directory / "ckpt"),
        "--log-dir",
        str(directory / "job"),
        *extra,
    ]


def progress(job_dir: Path, rank: int) -> list[dict[int, dict]]:
    """Per attempt, oldest first: ``{step: progress line}`` of ``rank``."""
    logs = sorted(
        (job_dir / "logs").glob(f"attempt_*/worker_{rank}.log"), key=lambda p: int(p.parent.name[8:])
    )
    found = []
    for log in [*logs, job_dir / "logs" / f"worker_{rank}.log"]:
        lines = [
            json.loads(x[len(PROGRESS) :]) for x in log.read_text().splitlines() if x.startswith(PROGRESS)
        ]
        found.append({line["step"]: line for line in lines if "step" in line})
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted job (P = 2), through the real harness."""
    directory = tmp_path_factory.mktemp("reference")
    assert main(run_argv(directory, "--ranks", "2", "--save-every", "2")) == 0
    return directory


def test_the_uninterrupted_job_reads_every_sample_once_per_epoch_reshuffled(reference):
    (rank0,) = progress(reference / "job", 0)
    (rank1,) = progress(reference / "job", 1)
    assert sorted(rank0) == sorted(rank1) == list(range(STEPS))
    assert all(rank0[s]["samples"] == rank1[s]["samples"] for s in rank0)  # one replica: one batch
    epochs = [
        [i for s in range(e * EPOCH_STEPS, (e + 1) * EPOCH_STEPS) for i in rank0[s]["samples"]]
        for e in range(STEPS // EPOCH_STEPS)
    ]
    for epoch in epochs:
        assert sorted(epoch) == list(range(EPOCH_STEPS * BATCH)), epoch
    assert epochs[0] != epochs[1]  # reshuffled per epoch


def test_a_rank_killed_mid_epoch_resumes_with_the_next_batch_and_the_same_losses(
    reference, tmp_path, capsys, monkeypatch
):
    """Rank 1 dies right before step 6 (index 5, in the middle of epoch 1); checkpoint 4 is the
    latest complete one. The relaunch's first batch is exactly step 4's, every step of every
    attempt reads the uninterrupted job's samples and ends with its loss, bit for bit."""
    monkeypatch.setattr(jobs, "WORKER", WORKERS / "restart_harness.py")
    monkeypatch.setenv("GRAPH_EXEC_TEST_KILL", "0:1:5")
    code = main(run_argv(tmp_path, "--ranks", "2", "--save-every", "2", "--max-restarts", "1"))
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "restarting, attempt 1 (restart 1 of at most 1), from checkpoint step 4" in out.err, out.err
    for rank in (0, 1):
        (ref,) = progress(reference / "job", rank)
        attempts = progress(tmp_path / "job", rank)
        assert len(attempts) == 2
        first, resumed = attempts
        assert sorted(first) == list(range(5)), sorted(first)  # died before step index 5
        assert min(resumed) == 4 and sorted(resumed) == list(range(4, STEPS))
        for per_step in attempts:
            for step, line in per_step.items():
                assert line["samples"] == ref[step]["samples"], (rank, step)
                assert line["loss"] == ref[step]["loss"], (rank, step, line["loss"], ref[step]["loss"])
    (last_rank_ref,) = progress(reference / "job", 1)
    assert progress(tmp_path / "job", 1)[-1][STEPS - 1]["loss"] == last_rank_ref[STEPS - 1]["loss"]
    assert last_rank_ref[STEPS - 1]["loss"] is not None


def test_two_replicas_read_disjoint_shards_every_sample_once_per_epoch(tmp_path):
    """``--ranks 2 --dp 2`` (two one-rank pipelines): per step the replicas' batches are disjoint,
    per epoch together every sample exactly once."""
    assert main(run_argv(tmp_path, "--ranks", "2", "--dp", "2", "--steps", str(2 * EPOCH_STEPS))) == 0
    (rep0,) = progress(tmp_path / "job", 0)
    (rep1,) = progress(tmp_path / "job", 1)
    rows = BATCH // 2
    for epoch in range(2):
        steps = range(epoch * EPOCH_STEPS, (epoch + 1) * EPOCH_STEPS)
        for step in steps:
            assert len(rep0[step]["samples"]) == len(rep1[step]["samples"]) == rows
            assert not set(rep0[step]["samples"]) & set(rep1[step]["samples"]), step
        read = [i for s in steps for i in rep0[s]["samples"] + rep1[s]["samples"]]
        assert sorted(read) == list(range(EPOCH_STEPS * BATCH)), (epoch, read)
