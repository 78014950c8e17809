"""``save_checkpoint`` and ``load_checkpoint``: called on every rank, every rank agrees.

Both follow the same pattern: each rank does its own part (write or check its file), then
every rank learns every rank's outcome through one exchange (:mod:`graph_exec.transport.gather`,
with the schedule's deadline). If any rank failed, *every* rank raises, the failing one with
its own error, the others with an error naming it and its reason — nobody waits on a peer
that gave up, and a load changes nothing on any rank unless every rank's checks passed.
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from graph_exec.checkpoint import index as tensor_index
from graph_exec.checkpoint import layout, state
from graph_exec.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ReshardWarning,
)
from graph_exec.checkpoint.facts import OPTIMIZER_PARTITION, differences, job_facts, local_stages

_ERRORS = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointCorruptError,
        CheckpointExistsError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
    )
}


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`save_checkpoint` wrote (returned on every rank)."""

    step: int
    path: Path  #: the step directory
    seconds: float  #: this rank's wall time in the save, waiting for the other ranks included
    bytes: int  #: size of this rank's file
    total_bytes: int  #: size of every rank's file together
    removed: tuple[int, ...]  #: older steps deleted after this one completed (rank 0; empty elsewhere)


def save_checkpoint(
    schedule: Any,
    directory: str | os.PathLike[str],
    step: int,
    optimizer: Any = None,
    *,
    keep: int | None = 2,
    timeout_s: float | None = None,
    data: Any = None,
    global_batch: int | None = None,
    job: dict[str, Any] | None = None,
) -> SavedCheckpoint:
    """Write what this rank owns to ``directory/step_<step>/rank_<rank>.ckpt``; call on every rank.

    This rank's file holds every parameter of its stage chunks and preprocess replica (frozen
    ones included), the loss scaler's scale and counter (with ``loss_scaler=``), this
    process's MindSpore generator state (``mindspore.get_rng_state()``) and, if
    ``optimizer`` is given, the optimizer's state, in MindSpore's own
    checkpoint format (``mindspore.load_checkpoint`` reads it). ``directory`` must be the same
    filesystem for every rank (shared by every host of a multi-host job): once every rank's
    file is on disk and rank 0 sees them all, rank 0 writes ``complete.json`` — world size, device mesh, schedule options,
    stage->rank map, a SHA-256 per rank file — and only then deletes complete checkpoints
    beyond the newest ``keep`` (``None``: keep all) and the debris of older failed saves.
    Call it between steps (after the optimizer update and ``zero_grad()``): accumulated
    gradients are not saved. ``step`` is the number of training steps done. Returns on every
    rank once the checkpoint is complete; raises on every rank if any rank failed, and the
    previous complete checkpoint stays the latest one. ``data``: a
    :class:`graph_exec.data.DataLoader` whose position (``state_dict()``) is recorded with this
    rank's entry, so that ``load_checkpoint(..., data=loader)`` continues with the next batch.
    ``global_batch``: the job's global batch size, recorded so that a load with another one is
    refused (the data position is a count of global batches). The manifest also holds the
    checkpoint's index (:mod:`graph_exec.checkpoint.index`: every tensor's name, shape, dtype
    and rank files), from which a job set up differently loads by name. ``job``: plain data the
    caller knows about its job (``graph-exec run``: the split), recorded for a launcher to say
    what changed on a resume.
    """
    began = time.perf_counter()
    folder = _directory(directory)
    step = _step(step, "step")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, Integral) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 (or None: keep every checkpoint), got {keep!r}")
    timeout = _timeout(schedule, timeout_s)
    rank, world = _where()
    what = f"saving checkpoint step {step} in {folder}"
    try:
        outcome, error = _save_rank(schedule, folder, step, (rank, world), optimizer, data), None
    except (CheckpointError, OSError, ValueError, TypeError, RuntimeError) as exc:
        outcome, error = _failure(rank, step, exc), exc
    outcomes = _exchange(outcome, world, timeout, what)
    _raise_failures(outcomes, error, rank, what)
    path = layout.step_dir(folder, step)
    removed: list[int] = []
    if rank == 0:
        try:
            _check_visible(path, outcomes)
            manifest = _manifest(schedule, world, step, outcomes, optimizer, global_batch, job)
            layout.write_json_atomically(path / layout.MANIFEST, manifest)
            removed = layout.prune(folder, step, keep, _warn)
            outcome, error = {"ok": True, "rank": 0, "step": step}, None
        except (CheckpointError, OSError, ValueError) as exc:
            outcome, error = _failure(0, step, exc), exc
    else:
        outcome = {"ok": True, "rank": rank, "step": step}
    _raise_failures(_exchange(outcome, world, timeout, what + " (manifest)"), error, rank, what)
    size = next(o["bytes"] for o in outcomes if o["rank"] == rank)
    return SavedCheckpoint(
        step,
        path,
        time.perf_counter() - began,
        size,
        sum(o["bytes"] for o in outcomes),
        tuple(removed),
    )


#: Bytes of rank files this process read in its latest load_checkpoint (checksums apart).
_READ = [0]


def last_load_bytes() -> int:
    """The bytes of checkpoint files this process read into memory in its latest
    :func:`load_checkpoint`: the records of the tensors it holds now, and the header and name
    of every record of the files it opened (under another plan a rank reads only its share, not
    the whole files that hold it). The checksum check streams each opened file besides, in
    fixed-size blocks, which this does not count."""
    return _READ[0]


def load_checkpoint(
    schedule: Any,
    directory: str | os.PathLike[str],
    optimizer: Any = None,
    step: int | None = None,
    *,
    timeout_s: float | None = None,
    data: Any = None,
    global_batch: int | None = None,
) -> int:
    """Load this rank's file of a complete checkpoint into the schedule's parameters (and the
    optimizer's state, if given); call on every rank. Returns the step loaded.

    ``step=None`` loads the latest complete step; if a rank file of it does not match the
    checksum recorded when it completed, every rank falls back to the previous complete step
    (``keep=2`` keeps one), with a warning naming the step, the rank and the file, and rank 0
    sets the corrupt step aside as ``step_<k>.corrupt`` (kept for inspection; the job can save
    step ``k`` again). Before anything is loaded on any rank, every rank checks that the
    checkpoint was written by a job set up like this one (world size, mesh, stage count, V,
    preprocess, schedule class and options, this rank's stages), that its file has the
    recorded checksum and that it holds exactly this rank's tensors, with their shapes; any
    other failure raises on every rank and leaves every parameter untouched. Restores each
    rank's MindSpore random-generator state where the checkpoint holds it. Works before the
    first ``run()``; values are copied in place, so compiled graphs stay valid.
    ``data``: the job's :class:`graph_exec.data.DataLoader`, moved to the position saved with
    ``save_checkpoint(..., data=)`` (checked with the rest before anything is loaded).

    **Another plan.** A checkpoint written under another D, P, V, split, schedule, number of
    transposed layers or ``optimizer_sharding`` loads too (with a warning listing what changed):
    each rank reads, by name through the checkpoint's index, only the tensors it holds now —
    parameters, optimizer state (under ZeRO-1 the moments of the parameters it updates now, from
    whichever replica's file holds them), the loss scaler — from the files that hold them (a
    replicated tensor from one copy). Refused on every rank before any rank communicates,
    naming it: a name or shape this rank holds that the checkpoint does not (another model),
    optimizer state missing for a parameter, another optimizer class, another ``global_batch``.
    A checkpoint parameter that no rank holds (another model) is refused on every rank after
    the ranks' one exchange, before anything is loaded. The generator state is restored only
    under the same plan, where ZeRO on or off counts as the same (docs/restarts.md).
    """
    folder = _directory(directory)
    if step is not None:
        step = _step(step, "step")
    timeout = _timeout(schedule, timeout_s)
    rank, world = _where()
    candidates = _candidate_steps(folder, step)
    for index, candidate in enumerate(candidates):
        what = (
            f"loading checkpoint step {candidate} from {folder}"
            if candidate is not None
            else f"loading the latest complete checkpoint from {folder}"
        )
        targets: dict[str, Any] = {}
        stored: dict[str, Any] = {}
        chosen = -1 if candidate is None else candidate
        _READ[0] = 0
        try:
            chosen, targets, stored = _check_rank_file(
                schedule, folder, candidate, optimizer, rank, world, global_batch
            )
            position = None if data is None else _data_position(folder, chosen, rank, data)
            outcome, error = {"ok": True, "rank": rank, "step": chosen, "claimed": sorted(targets)}, None
        except (CheckpointError, OSError, ValueError, TypeError, RuntimeError) as exc:
            outcome, error = _failure(rank, chosen, exc), exc
        outcomes = _exchange(outcome, world, timeout, what)
        failed = [o for o in outcomes if not o["ok"]]
        earlier = candidates[index + 1] if index + 1 < len(candidates) else None
        if step is None and earlier is not None and failed and all(o.get("corrupt") for o in failed):
            _fall_back(folder, chosen, earlier, failed, rank)
            continue
        _raise_failures(outcomes, error, rank, what, "nothing was loaded on any rank")
        _check_claimed(folder, chosen, outcomes, schedule, world, rank)
        state.assign(targets, stored)
        state.restore_rng_state(stored)
        if data is not None:
            data.load_state_dict(position)
        return chosen
    raise AssertionError("unreachable: the last candidate either loads or raises")


def _candidate_steps(folder: Path, step: int | None) -> list[int | None]:
    """The steps a load tries, in order: ``step``, or the latest complete one and each earlier
    one (a corrupt file falls back to the previous step); ``[None]`` when none is complete."""
    if step is not None:
        return [step]
    latest, skipped = layout.find_latest(folder, verify=False)  # each rank checks its own file
    for newer in skipped:
        _warn(newer.describe(folder))
    return [s for s in reversed(layout.complete_steps(folder)) if latest is not None and s <= latest] or [
        None
    ]


def _fall_back(folder: Path, corrupt: int, earlier: int, failed: Sequence[dict[str, Any]], rank: int) -> None:
    """Every rank: say that step ``corrupt`` is corrupt and ``earlier`` is loaded instead;
    rank 0 sets the corrupt step aside (before the next exchange, so every rank sees it gone)."""
    where = "; ".join(f"rank {o['rank']}: {o['error']}" for o in failed)
    aside = f"{layout.step_dir(folder, corrupt).name}.corrupt"
    if rank == 0:
        try:
            aside = layout.set_aside(folder, corrupt, "corrupt").name
        except OSError as exc:
            _warn(f"could not set corrupt checkpoint step {corrupt} aside: {exc}")
    warnings.warn(
        f"checkpoint step {corrupt} in {folder} is corrupt ({where}); loading the previous "
        f"complete step {earlier} instead; the corrupt step is set aside as {aside}",
        stacklevel=3,
    )


def _check_claimed(
    folder: Path, step: int, outcomes: Sequence[dict[str, Any]], schedule: Any, world: int, rank: int
) -> None:
    """Every rank, after the exchange: each model parameter of the checkpoint is held by some
    rank (else it was written for another model), and rank 0 says what changed in the plan."""
    manifest = _choose(folder, step)[1]
    saved_index = manifest.get("index")
    if saved_index is None:
        return
    claimed = {name for o in outcomes for name in o.get("claimed", ())}
    left = tensor_index.unclaimed(saved_index, claimed)
    if left:
        raise CheckpointMismatchError(
            f"checkpoint {layout.step_dir(folder, step)} holds model parameters that no rank of this job "
            f"has (written for another model?): {tensor_index.names(left)}; nothing was loaded on any rank"
        )
    found = differences(manifest, job_facts(schedule, world), rank, local_stages(schedule))
    if rank == 0 and found:
        warnings.warn(
            f"checkpoint step {step} in {folder} was written under another plan; loading it by name: "
            + "; ".join(found),
            ReshardWarning,
            stacklevel=3,
        )


def _save_rank(
    schedule: Any, folder: Path, step: int, where: tuple[int, int], optimizer: Any, data: Any
) -> dict[str, Any]:
    """Write this rank's file (parameters, optimizer state, generators) and return its outcome
    for the exchange: the file's checksum and size, the names it holds (the index's listing),
    this rank's job facts and the data position."""
    rank, world = where
    model = state.model_parameters(schedule)
    extra = {} if optimizer is None else state.optimizer_state(optimizer, model)
    rng = state.rng_state()
    outcome = _write_rank_file(schedule, folder, step, rank, {**model, **extra, **rng})
    outcome["optimizer"] = sorted(extra) if optimizer is not None else None
    outcome["listing"] = {
        **tensor_index.listing(model, "model"),
        **tensor_index.listing(extra, "optimizer"),
        **{name: {"shape": [], "dtype": "rng", "kind": "rng"} for name in rng},
    }
    outcome["facts"] = job_facts(schedule, world)  # per rank: ranks may legitimately differ
    outcome["data"] = None if data is None else data.state_dict()
    return outcome


def _manifest(
    schedule: Any,
    world: int,
    step: int,
    outcomes: Sequence[dict[str, Any]],
    optimizer: Any,
    global_batch: int | None,
    job: dict[str, Any] | None,
) -> dict[str, Any]:
    """``complete.json``: what rank 0 writes once every rank file is on disk."""
    return {
        "format": layout.FORMAT,
        "version": layout.VERSION,
        "step": step,
        "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **job_facts(schedule, world),  # rank 0's, for readers; each rank's are in "ranks"
        "stage_ranks": _stage_ranks(outcomes),
        "optimizer_class": None if optimizer is None else type(optimizer).__name__,
        "global_batch": global_batch,
        "job": job,
        "index": tensor_index.build(outcomes),
        "ranks": [{k: v for k, v in o.items() if k not in ("ok", "step", "listing")} for o in outcomes],
    }


def _data_position(folder: Path, step: int, rank: int, data: Any) -> dict[str, Any]:
    """The loader position saved with ``rank``'s entry of ``step`` (any rank's under another
    plan: a position counts global batches, the same on every rank), checked against ``data``."""
    entries = _choose(folder, step)[1]["ranks"]
    entry = next((e for e in entries if e["rank"] == rank), entries[0])
    saved = entry.get("data")
    if saved is None:
        raise CheckpointMismatchError(
            f"checkpoint step {step} holds no data-loader position for rank {rank} (saved without data=): "
            "load it without data= and position the loader yourself"
        )
    try:
        data.check_state(saved)
    except ValueError as exc:
        raise CheckpointMismatchError(f"checkpoint step {step}, rank {rank}: {exc}") from exc
    return saved


# -- one rank's part -------------------------------------------------------------------------


def _write_rank_file(
    schedule: Any, folder: Path, step: int, rank: int, tensors: dict[str, Any]
) -> dict[str, Any]:
    path = layout.step_dir(folder, step)
    if (path / layout.MANIFEST).exists():
        raise CheckpointExistsError(
            f"checkpoint step {step} already exists and is complete ({path}); checkpoints are never "
            "overwritten: save under another step or directory"
        )
    complete = layout.complete_steps(folder)
    if complete and complete[-1] > step:
        raise CheckpointError(
            f"step {step} is older than the latest complete checkpoint in {folder} (step {complete[-1]}), "
            "which load_checkpoint would keep choosing: save to a new directory, or delete "
            f"{layout.step_dir(folder, complete[-1])} first"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"rank {rank} cannot create checkpoint directory {path}: {exc}") from exc
    partial = path / layout.partial_file_name(rank)
    final = path / layout.rank_file_name(rank)
    try:
        partial.unlink(missing_ok=True)  # debris of an earlier attempt that died
        state.write(tensors, str(partial))
        checksum = layout.publish(partial, final)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"rank {rank} cannot write {final}: {type(exc).__name__}: {exc}") from exc
    return {
        "ok": True,
        "rank": rank,
        "step": step,
        "file": final.name,
        "sha256": checksum,
        "bytes": final.stat().st_size,
        "stages": local_stages(schedule),
        "tensors": len(tensors),
    }


def _check_visible(path: Path, outcomes: Sequence[dict[str, Any]]) -> None:
    """Rank 0, before the manifest: every rank's file must be on rank 0's disk, or the manifest
    would call complete a step that rank 0 cannot check (hosts with disks of their own)."""
    unseen = [o["rank"] for o in outcomes if not (path / o["file"]).is_file()]
    if unseen:
        raise CheckpointError(
            f"rank 0 cannot see the files of rank(s) {unseen} in {path}, which they wrote: the "
            "checkpoint directory must be one filesystem shared by every host (a shared or network "
            "filesystem), since rank 0 checks that every rank's file is there before the step counts "
            "as complete"
        )


def _check_rank_file(
    schedule: Any,
    folder: Path,
    step: int | None,
    optimizer: Any,
    rank: int,
    world: int,
    global_batch: int | None = None,
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Everything a load checks on this rank; returns (step, live targets, stored values).

    A checkpoint written under this job's plan is read from this rank's own file, generator
    state included (bit-exact). One written under another plan is read by name through its
    index (:mod:`graph_exec.checkpoint.index`), from the files that hold this rank's tensors
    now, the generator only where nothing but the optimizer's partition changed (ZeRO on or
    off: the same stages draw on the same rank); an old checkpoint without an index must match
    the plan.
    """
    chosen, manifest = _choose(folder, step)
    where = layout.step_dir(folder, chosen)
    _check_job(manifest, where, optimizer, global_batch)
    now, stages = job_facts(schedule, world), local_stages(schedule)
    found = differences(manifest, now, rank, stages)
    saved_index = manifest.get("index")
    if found and saved_index is None:
        raise CheckpointMismatchError(
            f"checkpoint {where} was written by a job set up differently: "
            + "; ".join(found)
            + " (it has no index of tensor names, written since resharding exists: load it under its own plan)"
        )
    model = state.model_parameters(schedule)
    extra = {} if optimizer is None else state.optimizer_state(optimizer, model)
    if saved_index is None:
        return (chosen, *_own_file(manifest, where, model, extra, rank, optimizer))
    own = next((e["file"] for e in manifest["ranks"] if e["rank"] == rank), None)  # read first
    wanted = {**tensor_index.want(model, "model"), **tensor_index.want(extra, "optimizer")}
    plan, problems = tensor_index.resolve(saved_index, wanted, own)
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit rank {rank}'s model: " + "; ".join(problems)
        )
    same_ranks = not differences(manifest, now, rank, stages, ignore=OPTIMIZER_PARTITION)
    if same_ranks and state.RNG_STATE in saved_index:  # this process's own generator
        plan.setdefault(own, []).append(state.RNG_STATE)
    stored: dict[str, Any] = {}
    for name, chosen_names in sorted(plan.items()):
        stored.update(_read_checked(where, name, manifest, set(chosen_names), rank, folder))
    return chosen, {**model, **extra}, stored


def _check_job(manifest: dict[str, Any], where: Path, optimizer: Any, global_batch: int | None) -> None:
    """What no plan can change: the optimizer (its class; its state, if asked for) and the global
    batch size."""
    saved_class = manifest.get("optimizer_class")
    if optimizer is not None and saved_class is not None and saved_class != type(optimizer).__name__:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds the state of optimizer class {saved_class}, this job's is "
            f"{type(optimizer).__name__}: optimizer state does not carry over to another optimizer class"
        )
    if optimizer is not None and all(e.get("optimizer") is None for e in manifest["ranks"]):
        raise CheckpointMismatchError(
            f"checkpoint {where} holds no optimizer state (it was saved without optimizer=): load it "
            "without optimizer= to take the weights only"
        )
    saved_batch = manifest.get("global_batch")
    if global_batch is not None and saved_batch is not None and saved_batch != global_batch:
        raise CheckpointMismatchError(
            f"checkpoint {where} was written with global batch size {saved_batch}, this job's is "
            f"{global_batch}: its data position (the next global batch) means other samples under "
            "another global batch size; resume with the same global batch"
        )


def _read_checked(
    where: Path, file: str, manifest: dict[str, Any], chosen: set[str] | None, rank: int, folder: Path
) -> dict[str, Any]:
    """The ``chosen`` tensors (``None``: all) of one rank file, after checking it against its recorded checksum."""
    entry = next(e for e in manifest["ranks"] if e["file"] == file)
    path = where / file
    whose = f"{path} (rank {entry['rank']}'s file of step {manifest['step']})" + (
        "" if entry["rank"] == rank else f", read by rank {rank},"
    )
    if layout.sha256_of(path) != entry["sha256"]:
        raise CheckpointCorruptError(
            f"{whose} does not match the checksum recorded when the checkpoint completed: the file was "
            "truncated or changed since. Restore it, or load an earlier complete step explicitly "
            f"(step=...; complete steps: {layout.complete_steps(folder)})"
        )
    try:
        tensors, count = state.read(str(path), chosen)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{whose} cannot be read: {exc}") from exc
    _READ[0] += count
    return tensors


def _own_file(
    manifest: dict[str, Any],
    where: Path,
    model: dict[str, Any],
    extra: dict[str, Any],
    rank: int,
    optimizer: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint without an index, under its own plan: this rank's own file holds everything."""
    entry = next(e for e in manifest["ranks"] if e["rank"] == rank)
    stored = _read_checked(where, entry["file"], manifest, None, rank, where.parent)
    saved_optimizer = set(entry.get("optimizer") or [])
    problems = state.mismatches(
        model,
        {k: v for k, v in stored.items() if k not in saved_optimizer and k != state.RNG_STATE},
        "model parameters",
    )
    if optimizer is not None:  # the checkpoint holds optimizer state (checked by _check_job)
        problems += state.mismatches(
            extra, {k: v for k, v in stored.items() if k in saved_optimizer}, "optimizer state"
        )
    if problems:
        raise CheckpointMismatchError(
            f"{where / entry['file']} (rank {rank}) does not fit this rank's model: " + "; ".join(problems)
        )
    return {**model, **extra}, stored


def _choose(folder: Path, step: int | None) -> tuple[int, dict[str, Any]]:
    if step is None:
        latest = layout.find_latest(folder, verify=False)[0]  # skipped steps: said by the caller
        if latest is None:
            leftovers = sorted(layout.step_dirs(folder))
            raise CheckpointNotFoundError(
                f"no complete checkpoint in {folder}"
                + (f" (incomplete steps, from saves that did not finish: {leftovers})" if leftovers else "")
            )
        step = latest
    manifest, why = layout.check_step(folder, step)
    if manifest is None:
        raise CheckpointNotFoundError(
            f"checkpoint step {step} in {folder} is not complete: {why}; complete steps: "
            f"{layout.complete_steps(folder)}"
        )
    return step, manifest


# -- agreement between ranks -----------------------------------------------------------------


def _where() -> tuple[int, int]:
    from graph_exec.transport import pipeline_rank
    from graph_exec.transport.gather import world_size

    return pipeline_rank(), world_size()


def _exchange(outcome: dict[str, Any], world: int, timeout_s: float, what: str) -> list[dict[str, Any]]:
    if world == 1:
        return [outcome]
    from graph_exec.transport.gather import all_gather_object

    return all_gather_object(outcome, timeout_s, what)


def _failure(rank: int, step: int, exc: BaseException) -> dict[str, Any]:
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "CheckpointError"
    return {
        "ok": False,
        "rank": rank,
        "step": step,
        "kind": kind,
        "error": f"{type(exc).__name__}: {exc}",
        "corrupt": isinstance(exc, CheckpointCorruptError),
    }


def _raise_failures(
    outcomes: Sequence[dict[str, Any]], own: BaseException | None, rank: int, what: str, note: str = ""
) -> None:
    """Raise on every rank if any rank failed or the ranks disagree on the step."""
    if own is not None:
        raise own
    failed = [o for o in outcomes if not o["ok"]]
    if failed:
        kind = _ERRORS[failed[0]["kind"]] if len({o["kind"] for o in failed}) == 1 else CheckpointError
        reasons = "; ".join(f"rank {o['rank']}: {o['error']}" for o in failed)
        where = f"this is rank {rank}" + (f"; {note}" if note else "")
        raise kind(f"{what} failed on rank(s) {[o['rank'] for o in failed]} ({where}): {reasons}")
    steps = {o["step"] for o in outcomes}
    if len(steps) > 1:
        per_rank = ", ".join(f"rank {o['rank']}: {o['step']}" for o in outcomes)
        raise CheckpointError(
            f"{what}: the ranks disagree on the step ({per_rank}); pass the same step everywhere"
        )


def _stage_ranks(outcomes: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """``{stage: [ranks holding it]}`` from every rank's own stages (JSON keys are strings)."""
    found: dict[int, list[int]] = {}
    for o in outcomes:
        for stage in o["stages"]:
            found.setdefault(stage, []).append(o["rank"])
    return {str(stage): ranks for stage, ranks in sorted(found.items())}


# -- arguments -------------------------------------------------------------------------------


def _directory(directory: Any) -> Path:
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise TypeError(f"directory must be a non-empty path (str or os.PathLike), got {directory!r}")
    return Path(directory).expanduser()


def _step(step: Any, name: str) -> int:
    if isinstance(step, bool) or not isinstance(step, Integral):
        raise TypeError(f"{name} must be an int >= 0 (the number of training steps done), got {step!r}")
    if step < 0:
        raise ValueError(f"{name} must be >= 0 (the number of training steps done), got {step}")
    return int(step)


def _timeout(schedule: Any, timeout_s: float | None) -> float:
    value = getattr(schedule, "timeout_s", 300.0) if timeout_s is None else timeout_s
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {value!r}")
    return float(value)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)
