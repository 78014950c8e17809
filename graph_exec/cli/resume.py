"""Where ``graph-exec run`` resumes from, decided and checked before anything launches.

Everything a resume needs to know is on disk already: which steps are complete, whether their
rank files still match the checksums recorded when they completed, and how the job that wrote
them was set up (``complete.json``). So a resume that cannot work — another ``--batch`` or
``--frozen``, a corrupt step asked for by name, nothing usable left — exits with code 2 here,
instead of failing on every rank after the launch. Another plan (``--ranks``, ``--dp``,
``--vpp``, ``--layers``, ``--baseline``, ``--zero``, ...: :data:`PLAN`) is said and goes on
when the checkpoint has an index of tensor names: the ranks load it by name. Pure Python: no MindSpore,
no msrun.

A corrupt latest step is skipped for the previous complete one (``keep=2`` keeps it), as
:func:`graph_exec.load_checkpoint` does; steps newer than the one resumed from are set aside
(renamed ``step_<k>.corrupt`` or ``step_<k>.superseded``, never deleted) right before the
launch, since the resumed job writes those steps again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graph_exec.checkpoint import layout
from graph_exec.checkpoint.facts import differences_from_expected
from graph_exec.report.job import JobSpec


class ResumeRefused(ValueError):
    """A resume that cannot work; the message names the step, the reason and the way out."""


@dataclass(frozen=True)
class ResumePoint:
    """The step a run starts from (0: the beginning), the newer steps to set aside before the
    launch (``(step, label)``), and the newer steps skipped, with why (to be said once)."""

    step: int
    set_aside: tuple[tuple[int, str], ...] = ()
    skipped: tuple[layout.Skipped, ...] = ()
    folder: Path = Path()
    changed: tuple[str, ...] = ()  #: how the plan differs from the checkpoint's (loaded by name)

    def notes(self, *, corrupt_only: bool = False) -> list[str]:
        """One line per skipped step (``corrupt_only``: leave out the debris of failed saves), and
        one saying what changed in the plan, if anything did."""
        lines = [s.describe(self.folder) for s in self.skipped if s.corrupt or not corrupt_only]
        if self.changed:
            lines.append(
                f"checkpoint step {self.step} was written under another plan, resuming by name: "
                + "; ".join(self.changed)
            )
        return lines


def expected_facts(job: JobSpec) -> dict[str, Any]:
    """What the manifest of a checkpoint this job can resume from must say (as far as the
    command line knows it; the ranks' own check at the load compares everything)."""
    spec = job.runs[0]
    options: dict[str, Any] = {
        "micro_batch_num": job.micro,
        "shapes": job.shapes,
        "optimizer_sharding": spec.optimizer_sharding,
    }
    if not spec.baseline:
        options.update(run_ahead=spec.run_ahead, backward=spec.backward)
    return {
        "world_size": job.ranks,
        "mesh": {"dp": job.dp, "pp": job.pp},
        "schedule": "ScheduleInterleaved1F1B" if spec.baseline else "ScheduleMPipeTranspose",
        "num_stages": job.pp * job.vpp,
        "vpp": job.vpp,
        "preprocess": spec.preprocess,
        "options": options,
        "global_batch": job.batch,
        "job": {"layers": list(spec.layers) if spec.layers else None},
    }


def choose(
    folder: Path,
    *,
    resume: bool,
    resume_step: int | None,
    expected: dict[str, Any] | None,
    data: str | None = None,
) -> ResumePoint:
    """Where a run with these flags starts (see the module docstring); raises :class:`ResumeRefused`.

    ``expected`` (:func:`expected_facts`) is compared with the chosen step's manifest; ``None``
    skips that (a relaunch of the same job). ``data`` (``--data``): ``"shuffled"`` needs a
    checkpoint that holds every rank's data-loader position, ``"steps"`` one without.
    """
    latest, skipped = layout.find_latest(folder)
    notes = [s.describe(folder) for s in skipped]
    complete = layout.complete_steps(folder)
    if not resume and resume_step is None:
        if complete:
            raise ResumeRefused(
                f"--checkpoint-dir {str(folder)!r} already holds checkpoints (latest: step {complete[-1]}): "
                "pass --resume to continue from it (or --resume-step K for an earlier complete step), "
                "or choose another directory"
            )
        return ResumePoint(0, (), tuple(skipped), folder)
    if resume_step is not None:
        step, manifest = _named_step(folder, resume_step, complete, skipped)
        corrupt = {s.step for s in skipped if s.corrupt}
        aside = tuple((s, "corrupt" if s in corrupt else "superseded") for s in complete if s > step)
        skipped = []  # the step was named: what is wrong with newer ones does not matter
    elif latest is None:
        if any(s.corrupt for s in skipped):
            raise ResumeRefused(
                f"--resume: no checkpoint in {folder} can be loaded: {'; '.join(notes)}. Restore the "
                "files, or start afresh in another --checkpoint-dir"
            )
        return ResumePoint(0, (), tuple(skipped), folder)
    else:
        step, manifest = latest, layout.read_manifest(folder, latest) or {}
        aside = tuple((s.step, "corrupt") for s in skipped if s.corrupt)
    found = [] if expected is None else differences_from_expected(manifest, expected)
    found += [] if expected is None else _job_differences(manifest, expected)
    if data is not None:
        written = "shuffled" if any(e.get("data") for e in manifest.get("ranks", ())) else "steps"
        if written != data:
            found.append(f"data: checkpoint {written!r}, this job {data!r}")
    changed: list[str] = []
    if "index" in manifest:  # loaded by name: the plan may change
        changed = [_with_flag(d) for d in found if d.split(": ", 1)[0] in PLAN]
        found = [d for d in found if d.split(": ", 1)[0] not in PLAN]
    if found:
        raise ResumeRefused(
            f"checkpoint step {step} in {folder} was written by a job set up differently: "
            + "; ".join(_with_flag(difference) for difference in found)
            + ". Resume with the flags it was written with, or use another --checkpoint-dir"
        )
    return ResumePoint(step, aside, tuple(skipped), folder, tuple(changed))


#: What a checkpoint with an index resumes across (by name): how the job is laid out, not what it
#: computes. The global batch, the preprocess's training, the shapes and the data stay. ZeRO-1
#: (``--zero``) only moves optimizer state between replicas: each rank reads the moments of the
#: parameters it updates now from whichever file the index names.
PLAN = frozenset(
    {
        "world size",
        "device mesh",
        "schedule class",
        "stage count",
        "V (stages per rank)",
        "split",
        "option run_ahead",
        "option backward",
        "option optimizer_sharding",
    }
)


def _job_differences(manifest: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The global batch and the split, where the checkpoint records them."""
    found = []
    saved_batch = manifest.get("global_batch")
    if saved_batch is not None and "global_batch" in expected and saved_batch != expected["global_batch"]:
        found.append(
            f"global batch: checkpoint {saved_batch}, this job {expected['global_batch']} (the data "
            f"position counts global batches: it does not carry over to another size; pass --batch "
            f"{saved_batch}, whose default depends on --ranks and --dp)"
        )
    saved = (manifest.get("job") or {}).get("layers", "<not recorded>")
    now = expected.get("job", {}).get("layers")
    if saved != "<not recorded>" and saved != now:
        found.append(f"split: checkpoint {_split_text(saved)}, this job {_split_text(now)}")
    return found


def _split_text(layers: list[int] | None) -> str:
    return "even" if layers is None else ",".join(map(str, layers))


#: The flags behind each fact :func:`expected_facts` compares.
_FLAGS = {
    "world size": "--ranks",
    "device mesh": "--dp",
    "schedule class": "--baseline",
    "stage count": "--ranks/--dp/--vpp",
    "V (stages per rank)": "--vpp",
    "preprocess": "--frozen/--trainable",
    "option micro_batch_num": "--micro",
    "option shapes": "--shapes",
    "option run_ahead": "--run-ahead",
    "option backward": "--backward",
    "option optimizer_sharding": "--zero",
    "data": "--data",
    "global batch": "--batch",
    "split": "--layers",
}


def _with_flag(difference: str) -> str:
    """``"V (stages per rank): checkpoint 2, ..."`` -> ``"V (stages per rank) (--vpp): ..."``."""
    label, rest = difference.split(": ", 1)
    return f"{label} ({_FLAGS[label]}): {rest}" if label in _FLAGS else difference


def _named_step(
    folder: Path, step: int, complete: list[int], skipped: list[layout.Skipped]
) -> tuple[int, dict[str, Any]]:
    """``--resume-step K``: K's manifest if K is complete and every rank file matches its checksum."""
    manifest, why = layout.check_step(folder, step)
    if manifest is None:
        raise ResumeRefused(
            f"--resume-step {step}: checkpoint step {step} in {folder} is not complete: {why}; "
            f"complete steps: {complete}"
        )
    bad = layout.corrupt_files(folder, manifest)
    if bad:
        usable = [s for s in complete if s < step and s not in {k.step for k in skipped}]
        earlier = (
            f"load an earlier complete step with --resume-step K (K among {usable})"
            if usable
            else "there is no earlier complete step"
        )
        raise ResumeRefused(
            f"--resume-step {step}: {', '.join(bad)} of checkpoint step {step} in {folder} "
            f"{'does' if len(bad) == 1 else 'do'} not match the checksum recorded when the step "
            f"completed (truncated or changed since): restore {'it' if len(bad) == 1 else 'them'}, or {earlier}"
        )
    return step, manifest


def set_aside(folder: Path, point: ResumePoint, say: Callable[[str], None]) -> None:
    """Rename the steps newer than ``point.step`` out of the way (the job writes them again)."""
    for step, label in point.set_aside:
        path = layout.set_aside(folder, step, label)
        why = (
            "its files failed their checksums"
            if label == "corrupt"
            else f"it is newer than step {point.step}"
        )
        say(f"checkpoint step {step} set aside as {path} ({why}; the resumed job writes step {step} again)")
