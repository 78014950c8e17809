"""A checkpoint's index: every saved tensor's name -> shape, dtype, kind and the rank files holding it.

Pure Python (no MindSpore), so a launcher and the unit tests read it as the ranks do. Rank 0
writes it into ``complete.json`` from what every rank reported it saved. Loading under another
plan (other D, P, V, split, schedule, ZeRO sharding) is then a matter of names: each rank asks
the index for the names it holds now and opens only the files that hold them. A tensor saved by
several ranks (the replicated preprocess, data-parallel replicas, the loss scaler, Adam's step
scalars) lists every file; a rank reads it from its own old file if that holds it (a same-plan
resume reads exactly what it wrote), else from the first one. A rank file holding only part of
the optimizer state (ZeRO) is just a file listed under fewer names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: What a saved tensor is: model parameter (or loss-scaler state), optimizer state, generator state.
KINDS = ("model", "optimizer", "rng")
#: MindSpore optimizers name a parameter's state ``<slot>.<parameter name>``.
OPTIMIZER_SLOTS = ("moment1.", "moment2.", "moments.", "accum.", "mean_grad.", "mean_square.")


def listing(tensors: Mapping[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """``{name: {"shape", "dtype", "kind"}}`` of tensors (anything with ``shape`` and ``dtype``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return {
        name: {"shape": [int(n) for n in value.shape], "dtype": str(value.dtype), "kind": kind}
        for name, value in tensors.items()
    }


def build(ranks: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The index from each rank's ``{"file", "listing"}`` (lowest rank first).

    Raises ``ValueError`` if two copies of a name differ in shape, dtype or kind: a replicated
    tensor must be the same everywhere, or which copy is loaded would matter.
    """
    index: dict[str, dict[str, Any]] = {}
    for entry in ranks:
        for name, facts in sorted(entry["listing"].items()):
            seen = index.get(name)
            if seen is None:
                index[name] = {**facts, "files": [entry["file"]]}
                continue
            if {k: seen[k] for k in facts} != facts:
                raise ValueError(
                    f"{name!r} is saved as {seen['shape']} {seen['dtype']} ({seen['kind']}) in "
                    f"{seen['files'][0]} and as {facts['shape']} {facts['dtype']} ({facts['kind']}) in "
                    f"{entry['file']}: copies of one tensor must agree"
                )
            seen["files"].append(entry["file"])
    return index


@dataclass(frozen=True)
class Want:
    """A live tensor a rank must load: its shape and dtype now, and what it is."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  #: "model" or "optimizer"


def want(tensors: Mapping[str, Any], kind: str) -> dict[str, Want]:
    """:class:`Want` of each live tensor (anything with ``shape`` and ``dtype``)."""
    return {name: Want(tuple(int(n) for n in v.shape), str(v.dtype), kind) for name, v in tensors.items()}


def parameter_of(name: str) -> str | None:
    """The parameter an optimizer-state name belongs to (``moment1.w`` -> ``w``), else ``None``."""
    return next((name[len(slot) :] for slot in OPTIMIZER_SLOTS if name.startswith(slot)), None)


def resolve(
    index: Mapping[str, Mapping[str, Any]], wanted: Mapping[str, Want], own_file: str | None
) -> tuple[dict[str, list[str]], list[str]]:
    """Which file to read each wanted name from: ``({file: [names]}, problems)``.

    ``own_file``: this rank's file in the checkpoint, preferred where it holds a name. Problems
    name each tensor that is missing or saved with another shape or dtype, model parameters
    and optimizer state told apart (another model; optimizer state missing for a parameter).
    """
    plan: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {"model": [], "optimizer": []}
    problems = []
    for name, live in sorted(wanted.items()):
        saved = index.get(name)
        if saved is None or saved["kind"] != live.kind:
            missing[live.kind].append(name)
            continue
        if tuple(saved["shape"]) != live.shape or saved["dtype"] != live.dtype:
            problems.append(
                f"{name}: checkpoint has {tuple(saved['shape'])} {saved['dtype']}, this rank has "
                f"{live.shape} {live.dtype}"
            )
            continue
        files = saved["files"]
        plan.setdefault(own_file if own_file in files else files[0], []).append(name)
    if missing["model"]:
        problems.insert(
            0,
            f"model parameters not in the checkpoint (written for another model?): {names(missing['model'])}",
        )
    if missing["optimizer"]:
        owners = sorted({parameter_of(n) or n for n in missing["optimizer"]})
        problems.append(
            f"optimizer state missing from the checkpoint: {names(missing['optimizer'])} "
            f"(for {names(owners)})"
        )
    return plan, problems


def unclaimed(index: Mapping[str, Mapping[str, Any]], claimed: Iterable[str]) -> list[str]:
    """Model parameters of the checkpoint that no rank of this job holds (another model)."""
    taken = set(claimed)
    return sorted(n for n, facts in index.items() if facts["kind"] == "model" and n not in taken)


def names(found: list[str], limit: int = 8) -> str:
    shown = ", ".join(found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")
