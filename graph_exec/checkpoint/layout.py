"""Where a checkpoint lives on disk and when it counts as complete (pure Python, no MindSpore).

``DIR/step_<k>/rank_<r>.ckpt`` holds what rank ``r`` owns at step ``k``;
``DIR/step_<k>/complete.json`` (the *manifest*) is written last, by rank 0, once every rank
file is on disk. A step is **complete** when its manifest parses and every rank file it lists
exists; anything else is the debris of a failed save and does not exist for loading. A
complete step whose rank file no longer matches the SHA-256 its manifest recorded is
*corrupt*: the latest step loads only if none of its files is, else the previous one does. Every
file is written under a temporary name, flushed, fsynced and renamed, and the directory is
fsynced after the rename, so a crash leaves either the old state or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "complete.json"
FORMAT = "graph-exec/checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.ckpt"


def partial_file_name(rank: int) -> str:
    """Where rank ``rank`` writes before the rename (ends in ``.ckpt``: MindSpore appends it otherwise)."""
    return f".rank_{rank}.partial.ckpt"


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames and deletions in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, final: Path) -> str:
    """fsync ``partial``, rename it to ``final``, fsync the directory; returns the file's sha256."""
    checksum = sha256_of(partial)
    fsync_file(partial)
    os.replace(partial, final)
    fsync_dir(final.parent)
    return checksum


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)


def check_step(directory: Path, step: int) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")`` if ``step`` is complete, else ``(None, why not)`` (see module docstring)."""
    path = step_dir(directory, step) / MANIFEST
    if not path.is_file():
        return None, f"no {MANIFEST} in {path.parent} (a save that did not finish)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"unreadable {path} ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"{path} is not a {FORMAT} manifest"
    if manifest.get("version") != VERSION:
        return (
            None,
            f"{path} has version {manifest.get('version')!r}, this graph_exec reads version {VERSION}",
        )
    missing = missing_rank_files(directory, manifest)
    if missing:
        return None, f"its manifest lists {', '.join(missing)}, which do not exist"
    return manifest, ""


def read_manifest(directory: Path, step: int) -> dict[str, Any] | None:
    """The manifest of ``step`` if the step is complete, else ``None``."""
    return check_step(directory, step)[0]


def missing_rank_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    folder = step_dir(directory, int(manifest["step"]))
    return [entry["file"] for entry in manifest["ranks"] if not (folder / entry["file"]).is_file()]


def step_dirs(directory: Path) -> dict[int, Path]:
    """Every ``step_<k>`` directory in ``directory``, complete or not."""
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def complete_steps(directory: Path) -> list[int]:
    """The complete steps in ``directory``, oldest first."""
    return sorted(s for s in step_dirs(directory) if read_manifest(directory, s) is not None)


def corrupt_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """The rank files of a complete step whose SHA-256 is not the one its manifest recorded
    (reads every file once: what a load would find, checked before any rank starts)."""
    folder = step_dir(directory, int(manifest["step"]))
    return [
        entry["file"]
        for entry in manifest["ranks"]
        if "sha256" in entry and sha256_of(folder / entry["file"]) != entry["sha256"]
    ]


@dataclass(frozen=True)
class Skipped:
    """A step newer than the latest usable one, and why it cannot be loaded."""

    step: int
    corrupt: bool  #: complete, but a rank file fails its checksum (else: incomplete)
    why: str

    def describe(self, directory: Path) -> str:
        kind = "corrupt" if self.corrupt else "incomplete"
        return f"skipping {kind} checkpoint step {self.step} in {directory}: {self.why}"


def find_latest(
    directory: str | os.PathLike[str], *, verify: bool = True
) -> tuple[int | None, list[Skipped]]:
    """The latest step that can be loaded (``None``: none) and every newer step skipped, newest first.

    A step is skipped when it is not complete or, with ``verify``, when a rank file does not
    match the checksum recorded when the step completed.
    """
    folder = Path(directory)
    skipped = []
    for step in sorted(step_dirs(folder), reverse=True):
        manifest, why = check_step(folder, step)
        if manifest is None:
            skipped.append(Skipped(step, False, why))
            continue
        bad = corrupt_files(folder, manifest) if verify else []
        if not bad:
            return step, skipped
        skipped.append(
            Skipped(
                step,
                True,
                f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not match the checksum recorded "
                "when the step completed (truncated or changed since)",
            )
        )
    return None, skipped


def latest_checkpoint(directory: str | os.PathLike[str], *, verify: bool = True) -> int | None:
    """The latest complete step in ``directory`` whose rank files match their checksums
    (``None`` if there is none): the step ``load_checkpoint`` loads by default.

    Pure Python: usable from a launcher or a shell script that decides whether to resume.
    A newer step that is not complete (a save that died, a rank file gone) or, with
    ``verify`` (the default; it reads every rank file of the steps it looks at), that fails
    its checksum is skipped with a warning naming the step and the reason: the previous
    complete step (``keep=2`` keeps one) is the latest then.
    """
    latest, skipped = find_latest(directory, verify=verify)
    for step in skipped:
        warnings.warn(step.describe(Path(directory)), stacklevel=2)
    return latest


def set_aside(directory: Path, step: int, label: str) -> Path:
    """Rename ``step_<step>`` to ``step_<step>.<label>`` (``.1``, ``.2``, ... if taken), so that
    it is no step any more (nothing loads, prunes or refuses a save because of it) while its
    files stay for the user to inspect. Returns the new path."""
    path = step_dir(directory, step)
    target = path.with_name(f"{path.name}.{label}")
    count = 0
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}.{label}.{count}")
    os.replace(path, target)
    fsync_dir(directory)
    return target


def remove_step(path: Path) -> None:
    """Delete one step directory: its manifest first, so a half-deleted step is never complete."""
    manifest = path / MANIFEST
    if manifest.exists():
        manifest.unlink()
        fsync_dir(path)
    shutil.rmtree(path)


def prune(directory: Path, newest: int, keep: int | None, on_error: Callable[[str], None]) -> list[int]:
    """After ``newest`` completed: delete complete steps beyond the newest ``keep`` and every
    incomplete step older than ``newest`` (debris of failed saves). Returns the deleted steps;
    a deletion that fails is reported through ``on_error`` and skipped (saving already succeeded)."""
    complete = complete_steps(directory)
    kept = set(complete if keep is None else complete[-keep:])
    removed = []
    for step, path in sorted(step_dirs(directory).items()):
        obsolete = step in complete and step not in kept
        debris = step not in complete and step < newest
        if not (obsolete or debris):
            continue
        try:
            remove_step(path)
            removed.append(step)
        except OSError as exc:
            on_error(f"could not delete old checkpoint {path}: {exc}")
    return removed
