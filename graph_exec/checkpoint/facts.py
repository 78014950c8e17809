"""What a checkpoint records about the job that wrote it, and what must match to load it.

The schedule's options are read off the schedule object by one function,
:func:`schedule_options`: every field of its ``options``
(:class:`~graph_exec.runtime.options.ScheduleOptions`) and every public attribute whose value is
plain data (numbers, strings, booleans, ``None`` and lists/dicts of them). An option added to a
schedule class later is thereby recorded and compared without touching this module; one that
was renamed is compared under its new name (:data:`RENAMED`). Attributes that change *how*
the same numbers are computed, not *what* is computed, are recorded but not compared
(:data:`EXECUTION_ONLY`): a job saved in graph mode may resume in pynative mode to debug.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

#: Options recorded for information but allowed to differ when loading (the compiler options, and
#: the bucket sizes of ``shapes="buckets"``: a masked loss gives the unpadded batch's numbers).
EXECUTION_ONLY = frozenset(
    {
        "mode",
        "timeout_s",
        "sync_steps",
        "dp_bucket_bytes",
        "recompute",
        "keep_preprocess_tape",
        "jit_options",
        "shape_buckets",
        "shape_pad_value",
        "tower_order",
    }
)
#: Options a checkpoint may record under an older name: old name -> name now.
RENAMED = {"overflow": "run_ahead"}
#: Options added after checkpoints were first written, with the value every job had before:
#: a checkpoint that does not record one was written with that value.
BEFORE_THE_OPTION = {"optimizer_sharding": False}
#: Options that change only which data-parallel replica keeps which parameter's optimizer state
#: (ZeRO-1): every rank still runs the same stages on the same data, so a checkpoint written with
#: another value is loaded by name (the state is in other files) yet is the same plan for the
#: generator, which each rank gets back as it saved it.
OPTIMIZER_PARTITION = frozenset({"optimizer_sharding"})
#: Attributes that hold the model or the mesh, not options (recorded through the other facts).
MODEL_ATTRIBUTES = frozenset({"stages", "preprocess_module", "loss_fn", "mesh"})


def _plain(value: Any) -> Any:
    """``value`` as JSON data, or raise ``TypeError`` if it is not plain data."""
    return json.loads(json.dumps(value, allow_nan=True))


def schedule_options(schedule: Any) -> dict[str, Any]:
    """Every option and public plain-data attribute of ``schedule`` (module docstring), by name."""
    values = dict(vars(schedule))
    declared = getattr(schedule, "options", None)
    if dataclasses.is_dataclass(declared):
        values.pop("options")
        values.update({f.name: getattr(declared, f.name) for f in dataclasses.fields(declared) if f.init})
    options = {}
    for name, value in sorted(values.items()):
        if name.startswith("_") or name in MODEL_ATTRIBUTES:
            continue
        try:
            options[name] = _plain(value)
        except (TypeError, ValueError):
            continue  # cells, stages, callables: not options
    return options


def preprocess_kind(schedule: Any) -> str:
    """``"trainable"``, ``"frozen"`` or ``"none"`` (a baseline folds the preprocess into stage 0)."""
    module = getattr(schedule, "preprocess_module", None)
    if module is None:
        return "none"
    return "trainable" if module.trainable_params() else "frozen"


def mesh_of(schedule: Any, world_size: int) -> dict[str, int]:
    """The device mesh: the schedule's own ``mesh`` (``dp_size`` x ``pp_size``) if it has one,
    else one pipeline over the whole world."""
    mesh = getattr(schedule, "mesh", None)
    if mesh is not None and hasattr(mesh, "dp_size") and hasattr(mesh, "pp_size"):
        return {"dp": int(mesh.dp_size), "pp": int(mesh.pp_size)}
    return {"dp": 1, "pp": world_size}


def local_stages(schedule: Any) -> list[int]:
    return [int(s.stage_index) for s in schedule.stages]


def job_facts(schedule: Any, world_size: int) -> dict[str, Any]:
    """What the manifest records about the job (the per-rank part is added by the save)."""
    return {
        "world_size": world_size,
        "mesh": mesh_of(schedule, world_size),
        "schedule": type(schedule).__name__,
        "num_stages": int(schedule.stages[0].num_stages),
        "vpp": len(schedule.stages),
        "preprocess": preprocess_kind(schedule),
        "options": schedule_options(schedule),
    }


_LABELS = {
    "world_size": "world size",
    "mesh": "device mesh",
    "schedule": "schedule class",
    "num_stages": "stage count",
    "vpp": "V (stages per rank)",
    "preprocess": "preprocess",
}


def differences(
    manifest: dict[str, Any],
    now: dict[str, Any],
    rank: int,
    stages: list[int],
    *,
    ignore: frozenset[str] = frozenset(),
) -> list[str]:
    """Every way the job that wrote ``manifest`` differs, as seen from ``rank``, from this one.

    ``now`` is :func:`job_facts` of this rank. It is compared with the facts the manifest
    records for the same rank (ranks may differ: the fair baseline needs the preprocess on
    rank 0 only), or with the job-wide ones for a rank the checkpoint has no file for.
    ``stages`` are this rank's stages, compared with the recorded stage->rank map. Options named
    in ``ignore`` are not compared (:data:`OPTIMIZER_PARTITION`: is the layout otherwise the same?).
    """
    entries = {entry["rank"]: entry for entry in manifest.get("ranks", [])}
    entry = entries.get(rank)
    saved = entry.get("facts", manifest) if entry is not None else manifest
    found = [
        f"{label}: checkpoint {saved.get(key)!r}, this job {now[key]!r}"
        for key, label in _LABELS.items()
        if saved.get(key) != now[key]
    ]
    saved_options = {RENAMED.get(name, name): value for name, value in saved.get("options", {}).items()}
    for name in sorted(set(saved_options) | set(now["options"])):
        if name in EXECUTION_ONLY or name in ignore:
            continue
        before = saved_options.get(name, BEFORE_THE_OPTION.get(name, "<not set>"))
        current = now["options"].get(name, "<not set>")
        if before != current:
            found.append(f"option {name}: checkpoint {before!r}, this job {current!r}")
    if entry is None:
        found.append(f"rank {rank}: the checkpoint has no file for it")
    elif entry["stages"] != stages:
        found.append(f"stages of rank {rank}: checkpoint {entry['stages']}, this job {stages}")
    return found


def differences_from_expected(manifest: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Every way the job that wrote ``manifest`` differs from a partial description of a job.

    ``expected`` holds some of :func:`job_facts`' keys (and some ``options``), as a launcher
    knows them before any rank runs; keys it does not hold are not compared. Used to refuse a
    resume before launching (the ranks' own check at the load compares everything).
    """
    found = [
        f"{label}: checkpoint {manifest.get(key)!r}, this job {expected[key]!r}"
        for key, label in _LABELS.items()
        if key in expected and manifest.get(key) != expected[key]
    ]
    saved_options = manifest.get("options", {})
    for name, current in sorted(expected.get("options", {}).items()):
        before = saved_options.get(name, BEFORE_THE_OPTION.get(name, "<not set>"))
        if before != current:
            found.append(f"option {name}: checkpoint {before!r}, this job {current!r}")
    return found
