"""Checkpoint layout, manifest comparison and the ``graph-exec run`` checkpoint flags, without
MindSpore tensors or msrun (the launcher is replaced by a tripwire)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from graph_exec.checkpoint import layout
from graph_exec.checkpoint.facts import differences, job_facts, mesh_of, schedule_options
from graph_exec.cli import jobs, main
from graph_exec.cli.run import progress_text


def fake_step(directory: Path, step: int, ranks: int = 2, complete: bool = True) -> Path:
    """A step directory as a save leaves it (rank files are placeholders)."""
    folder = layout.step_dir(directory, step)
    folder.mkdir(parents=True)
    entries = []
    for rank in range(ranks):
        (folder / layout.rank_file_name(rank)).write_bytes(b"x")
        entries.append({"rank": rank, "file": layout.rank_file_name(rank), "stages": [rank]})
    if complete:
        manifest = {"format": layout.FORMAT, "version": layout.VERSION, "step": step, "ranks": entries}
        layout.write_json_atomically(folder / layout.MANIFEST, manifest)
    return folder


def quiet_latest(directory: Path) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return layout.latest_checkpoint(directory)


def test_latest_skips_incomplete_steps_and_says_why(tmp_path):
    assert layout.latest_checkpoint(tmp_path / "missing") is None
    fake_step(tmp_path, 3)
    fake_step(tmp_path, 6, complete=False)
    (fake_step(tmp_path, 9) / "rank_1.ckpt").unlink()
    (tmp_path / "step_x").mkdir()  # not a step
    (tmp_path / "step_12").write_text("a file, not a step")
    with pytest.warns(UserWarning) as seen:
        assert layout.latest_checkpoint(tmp_path) == 3
    text = " | ".join(str(w.message) for w in seen)
    assert "step 9" in text and "rank_1.ckpt, which do not exist" in text
    assert "step 6" in text and "no complete.json" in text
    assert layout.complete_steps(tmp_path) == [3]


def test_foreign_or_garbled_manifest_is_not_complete(tmp_path):
    folder = fake_step(tmp_path, 1)
    (folder / layout.MANIFEST).write_text("{not json")
    assert layout.check_step(tmp_path, 1)[0] is None and "unreadable" in layout.check_step(tmp_path, 1)[1]
    (folder / layout.MANIFEST).write_text(json.dumps({"format": "other"}))
    assert "not a graph-exec/checkpoint manifest" in layout.check_step(tmp_path, 1)[1]
    (folder / layout.MANIFEST).write_text(json.dumps({"format": layout.FORMAT, "version": 99}))
    assert "version 99" in layout.check_step(tmp_path, 1)[1]


def test_prune_keeps_the_newest_and_removes_older_debris(tmp_path):
    for step in (1, 2, 4):
        fake_step(tmp_path, step)
    fake_step(tmp_path, 3, complete=False)  # a save that died, older than the newest
    errors: list[str] = []
    assert layout.prune(tmp_path, 4, 2, errors.append) == [1, 3]
    assert sorted(layout.step_dirs(tmp_path)) == [2, 4] and not errors
    fake_step(tmp_path, 5, complete=False)  # newer than the step just completed: left alone
    assert layout.prune(tmp_path, 4, None, errors.append) == []
    assert sorted(layout.step_dirs(tmp_path)) == [2, 4, 5]


def test_publish_renames_and_returns_the_checksum(tmp_path):
    partial = tmp_path / layout.partial_file_name(0)
    partial.write_bytes(b"payload")
    final = tmp_path / layout.rank_file_name(0)
    checksum = layout.publish(partial, final)
    assert not partial.exists() and final.read_bytes() == b"payload"
    assert checksum == layout.sha256_of(final) and len(checksum) == 64


class FakeSchedule:
    """What the facts read off a schedule: public attributes, stages, preprocess, mesh."""

    def __init__(self, stages=(0, 2), num_stages=4, **options):
        self.stages = tuple(SimpleNamespace(stage_index=s, num_stages=num_stages) for s in stages)
        self.preprocess_module = None
        self.micro_batch_num = 4
        self.overflow = "full"
        self.mode = "graph"
        self.loss_fn = print  # not plain data: not an option
        self._private = 1
        vars(self).update(options)


def test_options_are_every_public_plain_attribute():
    options = schedule_options(FakeSchedule(recompute=["stage", 1]))
    assert options == {"micro_batch_num": 4, "mode": "graph", "overflow": "full", "recompute": ["stage", 1]}


def test_mesh_comes_from_the_schedule_when_it_has_one():
    assert mesh_of(FakeSchedule(), 4) == {"dp": 1, "pp": 4}
    assert mesh_of(FakeSchedule(mesh=None), 4) == {"dp": 1, "pp": 4}
    assert mesh_of(FakeSchedule(mesh=SimpleNamespace(dp_size=2, pp_size=2)), 4) == {"dp": 2, "pp": 2}


def test_differences_list_everything_that_differs_but_execution_only_options():
    saved = {
        **job_facts(FakeSchedule(), 2),
        "ranks": [{"rank": 0, "stages": [0, 2]}, {"rank": 1, "stages": [1, 3]}],
    }
    now = job_facts(FakeSchedule(stages=(0, 1, 2), num_stages=6, overflow="min", mode="pynative"), 3)
    found = differences(saved, now, 0, [0, 1, 2])
    assert found == [
        "world size: checkpoint 2, this job 3",
        "device mesh: checkpoint {'dp': 1, 'pp': 2}, this job {'dp': 1, 'pp': 3}",
        "stage count: checkpoint 4, this job 6",
        "V (stages per rank): checkpoint 2, this job 3",
        "option overflow: checkpoint 'full', this job 'min'",
        "stages of rank 0: checkpoint [0, 2], this job [0, 1, 2]",
    ]
    assert differences(saved, job_facts(FakeSchedule(mode="pynative"), 2), 0, [0, 2]) == []
    assert differences(saved, job_facts(FakeSchedule(), 2), 2, [0, 2]) == [
        "rank 2: the checkpoint has no file for it"
    ]


# -- graph-exec run flags ---------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("msrun was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--save-every", "2"], "--save-every and --resume need --checkpoint-dir DIR"),
        (["--resume"], "--save-every and --resume need --checkpoint-dir DIR"),
        (["--save-every", "0", "--checkpoint-dir", "x"], "argument --save-every: invalid value '0'"),
    ],
)
def test_bad_checkpoint_flags_exit_2(capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main(["run", "embed_lm", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.usefixtures("no_launch")
def test_checkpoint_dir_rules(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["run", "embed_lm", "--checkpoint-dir", str(blocker / "ckpt")])
    assert exc.value.code == 2 and "is a file" in capsys.readouterr().err
    fake_step(tmp_path / "ckpt", 4)
    with pytest.raises(SystemExit) as exc:
        main(["run", "embed_lm", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert (
        exc.value.code == 2
        and "already holds checkpoints (latest: step 4): pass --resume" in capsys.readouterr().err
    )
    assert (
        main(["run", "embed_lm", "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]) == 0
    )
    assert "nothing to do: the latest checkpoint is step 4, --steps is 4" in capsys.readouterr().out


def test_resumed_job_covers_the_remaining_steps(tmp_path):
    import argparse

    from graph_exec.cli.run import job_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    fake_step(tmp_path, 3)
    args = parser.parse_args(
        [
            "run",
            "embed_lm",
            "--steps",
            "8",
            "--save-every",
            "2",
            "--checkpoint-dir",
            str(tmp_path),
            "--resume",
        ]
    )
    job = job_from_args(args, parser)
    assert (job.first_step, job.end_step, job.warmup, job.steps) == (3, 8, 1, 4)
    assert (job.save_every, job.checkpoint_dir) == (2, str(tmp_path))
    from graph_exec.harness.training import checkpoint_due

    assert [k for k in range(4, 9) if checkpoint_due(job, k)] == [4, 6, 8]


def test_progress_lines_say_when_a_checkpoint_was_written():
    line = {
        "step": 3,
        "loss": 1.5,
        "seconds": 0.25,
        "checkpoint": {"path": "d/step_4", "seconds": 0.04, "bytes": 2**20},
    }
    assert progress_text(line, 8) == (
        "step   4/8  loss 1.5000  last stage's run()    250.0 ms  checkpoint written to d/step_4 in 40 ms (1.00 MiB, all ranks)"
    )
    assert (
        progress_text({"resumed": 4, "seconds": 0.5}, 8)
        == "resumed from checkpoint step 4 (loaded in 500 ms)"
    )


def test_each_rank_is_compared_with_its_own_recorded_facts():
    """The fair baseline needs the preprocess on rank 0 only: rank 1 may hold none, on both jobs."""
    with_pre = FakeSchedule(stages=(0, 2))
    with_pre.preprocess_module = SimpleNamespace(trainable_params=lambda: [1])
    without = FakeSchedule(stages=(1, 3))
    saved = {
        **job_facts(with_pre, 2),
        "ranks": [
            {"rank": 0, "stages": [0, 2], "facts": job_facts(with_pre, 2)},
            {"rank": 1, "stages": [1, 3], "facts": job_facts(without, 2)},
        ],
    }
    assert differences(saved, job_facts(without, 2), 1, [1, 3]) == []
    assert differences(saved, job_facts(without, 2), 0, [0, 2]) == [
        "preprocess: checkpoint 'trainable', this job 'none'"
    ]


def checksummed_step(directory: Path, step: int, ranks: int = 2) -> Path:
    """A complete step whose manifest records each rank file's SHA-256, as a save writes it."""
    folder = fake_step(directory, step, ranks)
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    for entry in manifest["ranks"]:
        (folder / entry["file"]).write_bytes(f"step {step} rank {entry['rank']}".encode())
        entry["sha256"] = layout.sha256_of(folder / entry["file"])
    layout.write_json_atomically(folder / layout.MANIFEST, manifest)
    return folder


def test_a_corrupt_latest_step_falls_back_to_the_previous_one_and_says_why(tmp_path):
    checksummed_step(tmp_path, 2)
    newest = checksummed_step(tmp_path, 4)
    (newest / "rank_1.ckpt").write_bytes(b"changed since")
    with pytest.warns(UserWarning) as seen:
        assert layout.latest_checkpoint(tmp_path) == 2
    (message,) = [str(w.message) for w in seen]
    assert message == (
        f"skipping corrupt checkpoint step 4 in {tmp_path}: rank_1.ckpt does not match the checksum "
        "recorded when the step completed (truncated or changed since)"
    )
    assert quiet_latest(tmp_path) == 2
    assert layout.latest_checkpoint(tmp_path, verify=False) == 4  # files present: complete
    latest, skipped = layout.find_latest(tmp_path)
    assert latest == 2 and [(s.step, s.corrupt) for s in skipped] == [(4, True)]
    aside = layout.set_aside(tmp_path, 4, "corrupt")
    assert aside.name == "step_4.corrupt" and (aside / "rank_1.ckpt").is_file()
    assert sorted(layout.step_dirs(tmp_path)) == [2] and layout.latest_checkpoint(tmp_path) == 2
    checksummed_step(tmp_path, 4)
    assert layout.set_aside(tmp_path, 4, "corrupt").name == "step_4.corrupt.1"  # never overwrites
