"""Checkpoint layout, manifest comparison and the ``graph-exec run`` checkpoint flags, without
MindSpore tensors or msrun (the launcher is replaced by a tripwire)."""

from __future__ import annotations

import argparse
import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from graph_exec.checkpoint import layout
from graph_exec.checkpoint.facts import (
    differences,
    differences_from_expected,
    job_facts,
    mesh_of,
    schedule_options,
)
from graph_exec.cli import jobs, main
from graph_exec.cli.run import progress_text


@functools.cache
def run_facts(*argv: str) -> dict:
    """The facts a checkpoint of ``graph-exec run embed_lm *argv`` records, as far as the
    command line knows them (what its pre-launch check compares)."""
    from graph_exec.cli.resume import expected_facts
    from graph_exec.cli.run import job_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return expected_facts(job_from_args(parser.parse_args(["run", "embed_lm", *argv]), parser))


def fake_step(
    directory: Path, step: int, ranks: int = 2, complete: bool = True, facts: dict | None = None
) -> Path:
    """A step directory as a save leaves it (rank files are placeholders), written by a job
    with ``facts`` (default: ``graph-exec run embed_lm``'s)."""
    folder = layout.step_dir(directory, step)
    folder.mkdir(parents=True)
    entries = []
    for rank in range(ranks):
        (folder / layout.rank_file_name(rank)).write_bytes(b"x")
        entries.append({"rank": rank, "file": layout.rank_file_name(rank), "stages": [rank]})
    if complete:
        manifest = {
            **(run_facts() if facts is None else facts),
            "format": layout.FORMAT,
            "version": layout.VERSION,
            "step": step,
            "ranks": entries,
        }
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
        self.run_ahead = "full"
        self.mode = "graph"
        self.loss_fn = print  # not plain data: not an option
        self._private = 1
        vars(self).update(options)


def test_options_are_every_public_plain_attribute():
    options = schedule_options(FakeSchedule(recompute=["stage", 1]))
    assert options == {"micro_batch_num": 4, "mode": "graph", "run_ahead": "full", "recompute": ["stage", 1]}


def test_options_come_from_the_schedules_options_dataclass_too():
    @dataclass(frozen=True)
    class Options:
        jit_options: dict = field(default_factory=dict)
        derived: object = field(default=None, init=False)  # made from the others: not an option

    options = schedule_options(FakeSchedule(options=Options({"jit_level": "O1"})))
    assert options["jit_options"] == {"jit_level": "O1"} and "options" not in options
    assert "derived" not in options and options["run_ahead"] == "full"


def test_mesh_comes_from_the_schedule_when_it_has_one():
    assert mesh_of(FakeSchedule(), 4) == {"dp": 1, "pp": 4}
    assert mesh_of(FakeSchedule(mesh=None), 4) == {"dp": 1, "pp": 4}
    assert mesh_of(FakeSchedule(mesh=SimpleNamespace(dp_size=2, pp_size=2)), 4) == {"dp": 2, "pp": 2}


def test_differences_list_everything_that_differs_but_execution_only_options():
    saved = {
        **job_facts(FakeSchedule(), 2),
        "ranks": [{"rank": 0, "stages": [0, 2]}, {"rank": 1, "stages": [1, 3]}],
    }
    now = job_facts(FakeSchedule(stages=(0, 1, 2), num_stages=6, run_ahead="min", mode="pynative"), 3)
    found = differences(saved, now, 0, [0, 1, 2])
    assert found == [
        "world size: checkpoint 2, this job 3",
        "device mesh: checkpoint {'dp': 1, 'pp': 2}, this job {'dp': 1, 'pp': 3}",
        "stage count: checkpoint 4, this job 6",
        "V (stages per rank): checkpoint 2, this job 3",
        "option run_ahead: checkpoint 'full', this job 'min'",
        "stages of rank 0: checkpoint [0, 2], this job [0, 1, 2]",
    ]
    assert differences(saved, job_facts(FakeSchedule(mode="pynative"), 2), 0, [0, 2]) == []
    assert differences(saved, job_facts(FakeSchedule(), 2), 2, [0, 2]) == [
        "rank 2: the checkpoint has no file for it"
    ]


def test_zero_switched_is_a_difference_that_the_generator_check_can_leave_out():
    """A load tells "only the optimizer's partition changed" (its generator state comes back)
    from another plan by comparing without :data:`OPTIMIZER_PARTITION`."""
    from graph_exec.checkpoint.facts import OPTIMIZER_PARTITION

    saved = {**job_facts(FakeSchedule(), 2), "ranks": [{"rank": 0, "stages": [0, 2]}]}
    now = job_facts(FakeSchedule(optimizer_sharding=True), 2)
    assert differences(saved, now, 0, [0, 2]) == [
        "option optimizer_sharding: checkpoint False, this job True"  # not recorded: before the option
    ]
    assert differences(saved, now, 0, [0, 2], ignore=OPTIMIZER_PARTITION) == []
    moved = job_facts(FakeSchedule(optimizer_sharding=True, run_ahead="min"), 2)
    assert differences(saved, moved, 0, [0, 2], ignore=OPTIMIZER_PARTITION) == [
        "option run_ahead: checkpoint 'full', this job 'min'"
    ]


def test_a_checkpoint_that_records_the_old_name_overflow_compares_it_as_run_ahead():
    old = job_facts(FakeSchedule(), 2)
    old["options"]["overflow"] = old["options"].pop("run_ahead")  # written before the rename
    old["ranks"] = [{"rank": 0, "stages": [0, 2]}]
    assert differences(old, job_facts(FakeSchedule(), 2), 0, [0, 2]) == []
    assert differences(old, job_facts(FakeSchedule(run_ahead="min"), 2), 0, [0, 2]) == [
        "option run_ahead: checkpoint 'full', this job 'min'"
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
        (["--save-every", "2"], "--save-every, --resume and --resume-step need --checkpoint-dir DIR"),
        (["--resume"], "--save-every, --resume and --resume-step need --checkpoint-dir DIR"),
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


def test_a_launcher_compares_only_what_it_knows():
    saved = job_facts(FakeSchedule(), 2)
    assert differences_from_expected(saved, {"vpp": 2, "options": {"micro_batch_num": 4}}) == []
    assert differences_from_expected(
        saved, {"vpp": 1, "world_size": 2, "options": {"micro_batch_num": 8}}
    ) == [
        "V (stages per rank): checkpoint 2, this job 1",
        "option micro_batch_num: checkpoint 4, this job 8",
    ]


# -- graph-exec run: resume checks before the launch --------------------------------------------


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """``graph-exec run`` up to the launch: the job it would launch is recorded, exit code 7."""
    from graph_exec.cli import run

    jobs_seen: list = []

    def execute(job, *args, **kwargs):
        jobs_seen.append(job)
        raise jobs.JobFailed(7)

    monkeypatch.setattr(run, "execute", execute)
    return jobs_seen


def run_argv(directory: Path, *extra: str) -> list[str]:
    return ["run", "embed_lm", "--steps", "12", "--checkpoint-dir", str(directory), *extra]


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--micro", "2", "--resume"], "option micro_batch_num (--micro): checkpoint 4, this job 2"),
        (["--vpp", "1", "--resume"], "V (stages per rank) (--vpp): checkpoint 2, this job 1"),
        (["--vpp", "1", "--resume-step", "3"], "V (stages per rank) (--vpp): checkpoint 2, this job 1"),
        (["--baseline", "--resume"], "schedule class (--baseline): checkpoint 'ScheduleMPipeTranspose'"),
        (
            ["--frozen", "--resume"],
            "preprocess (--frozen/--trainable): checkpoint 'trainable', this job 'frozen'",
        ),
        (["--data", "shuffled", "--resume"], "data (--data): checkpoint 'steps', this job 'shuffled'"),
        (  # a checkpoint without an index: only a load by name could move the optimizer state
            ["--dp", "2", "--zero", "1", "--resume"],
            "option optimizer_sharding (--zero): checkpoint False, this job True",
        ),
    ],
)
def test_a_resume_set_up_differently_exits_2_before_launching(tmp_path, capsys, extra, message):
    checksummed_step(tmp_path, 3)
    checksummed_step(tmp_path, 6)
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, *extra))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert "was written by a job set up differently" in err
    assert sorted(layout.step_dirs(tmp_path)) == [3, 6]  # nothing was touched


@pytest.mark.usefixtures("no_launch")
def test_a_corrupt_step_asked_for_exits_2_naming_the_flag_to_load_an_earlier_one(tmp_path, capsys):
    checksummed_step(tmp_path, 3)
    (checksummed_step(tmp_path, 6) / "rank_0.ckpt").write_bytes(b"changed")
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, "--resume-step", "6"))
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--resume-step 6: rank_0.ckpt of checkpoint step 6" in err
    assert "load an earlier complete step with --resume-step K (K among [3])" in err, err
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, "--resume-step", "5"))
    assert exc.value.code == 2 and "--resume-step 5: checkpoint step 5 in" in capsys.readouterr().err


@pytest.mark.usefixtures("no_launch")
def test_every_checkpoint_corrupt_exits_2(tmp_path, capsys):
    (checksummed_step(tmp_path, 3) / "rank_1.ckpt").write_bytes(b"changed")
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, "--resume"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--resume: no checkpoint in" in err and "rank_1.ckpt does not match" in err


def test_a_corrupt_latest_step_is_skipped_and_set_aside_before_the_launch(tmp_path, capsys, launched):
    checksummed_step(tmp_path, 3)
    (checksummed_step(tmp_path, 6) / "rank_1.ckpt").write_bytes(b"changed")
    fake_step(tmp_path, 9, complete=False)
    assert main(run_argv(tmp_path, "--resume")) == 7
    (job,) = launched
    assert job.first_step == 3 and job.end_step == 12
    err = capsys.readouterr().err
    assert err.count("skipping incomplete checkpoint step 9") == 1, err  # said once
    assert err.count("skipping corrupt checkpoint step 6") == 1, err
    assert f"checkpoint step 6 set aside as {tmp_path / 'step_6.corrupt'}" in err
    assert sorted(layout.step_dirs(tmp_path)) == [3, 9] and (tmp_path / "step_6.corrupt").is_dir()


def test_resume_step_loads_an_earlier_step_and_sets_the_newer_ones_aside(tmp_path, capsys, launched):
    for step in (3, 6, 9):
        checksummed_step(tmp_path, step)
    assert main(run_argv(tmp_path, "--resume-step", "6")) == 7
    (job,) = launched
    assert (job.first_step, job.end_step) == (6, 12)
    assert f"checkpoint step 9 set aside as {tmp_path / 'step_9.superseded'}" in capsys.readouterr().err
    assert layout.latest_checkpoint(tmp_path) == 6


def test_the_pre_launch_check_compares_options_under_the_names_checkpoints_record():
    """A checkpoint records the schedule's options by their ``ScheduleOptions`` names (and
    ``micro_batch_num``); the command line's expected facts must use the same names, or every
    resume is refused (``overflow`` after its rename to ``run_ahead`` was)."""
    from dataclasses import fields

    from graph_exec.runtime.options import ScheduleOptions

    recorded = {f.name for f in fields(ScheduleOptions) if f.init} | {"micro_batch_num"}
    for argv in ((), ("--baseline",), ("--run-ahead", "min", "--backward", "owner")):
        compared = set(run_facts(*argv)["options"])
        assert compared <= recorded, (argv, sorted(compared - recorded))


def test_a_shuffled_data_checkpoint_resumes_only_with_data_shuffled(tmp_path, capsys, launched):
    """``--data shuffled`` saves every rank's loader position: resuming it as ``--data steps``
    (which would ignore the position) exits 2 before the launch; ``--data shuffled`` launches."""
    folder = checksummed_step(tmp_path, 3)
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    for entry in manifest["ranks"]:
        entry["data"] = {"epoch": 1, "step": 0}
    layout.write_json_atomically(folder / layout.MANIFEST, manifest)
    with pytest.raises(SystemExit) as exc:
        main(run_argv(tmp_path, "--resume"))
    assert exc.value.code == 2
    assert "data (--data): checkpoint 'shuffled', this job 'steps'" in capsys.readouterr().err
    assert main(run_argv(tmp_path, "--resume", "--data", "shuffled")) == 7
    (job,) = launched
    assert job.first_step == 3 and job.data == "shuffled"
