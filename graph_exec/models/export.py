"""Write a split model back as one Hugging Face ``save_pretrained`` directory, from every rank.

:func:`export_pretrained` is called on every rank of the pipeline with the rank's
:class:`~graph_exec.models.SplitModel` (the schedules train its Parameters in place). Each
parameter is written once, by one rank: a chunk's by its own rank; the replicated preprocess,
the embedding and the buffers no chunk holds by pipeline rank 0; the head's copy of a tied pair not at all (the tied pair
is one tensor, the embedding's, as a tied checkpoint holds it). Names are Hugging Face's
(:func:`graph_exec.models.pretrained.checkpoint_names`).

Streaming. Shards never cross ranks: each rank packs its own tensors into shards of at most
``max_shard_size`` bytes and writes them one at a time, from its own parameters, so no host
ever holds more than one shard beyond its share and no tensor data travels between ranks.
Only the list of names and sizes is exchanged (one small all-gather), so that every rank
numbers the shards the same way.

Safety. Everything is written into a temporary sibling directory (``.NAME.exporting``), then
rank 0 writes the index and ``config.json`` and renames it to ``out_dir``: a crash leaves no
directory that ``from_pretrained`` would accept under ``out_dir``. The safetensors metadata
says ``format: pt``: PyTorch ``transformers`` refuses anything else (mindone's own
``save_pretrained`` writes ``np``), and mindone's ``from_pretrained`` reads either.

Dtype. The export is written in the checkpoint's own dtype unless told (``dtype``): the
config's ``torch_dtype`` (a Hub checkpoint's is ``bfloat16``), float32 parameters rounded to
nearest even (:mod:`graph_exec.hub.dtypes`). A BF16 directory loaded and exported untrained
is reproduced bit for bit, whether it was loaded as float32 or kept in BF16.

A complete directory. Everything of the directory the model was loaded from that is not weights
(tokenizer, processor and chat template files, ``generation_config.json``) is copied into the
export, so ``from_pretrained`` of the export serves as the original did.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from graph_exec.hub.directory import INDEX_FILE, SINGLE_FILE
from graph_exec.hub.dtypes import FLOAT_NAMES, as_stored, config_dtype, stored_name, write_safetensors
from graph_exec.models.pretrained import MODEL_CLASSES
from graph_exec.models.split import SplitModel

#: Bytes per shard unless told (Hugging Face's default is 5 GB; smaller shards stream better).
DEFAULT_SHARD_BYTES = 2 * 2**30
#: Files that hold weights (of any framework): an export writes its own, never copies these.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".npz")
#: Files an export writes itself.
WRITTEN_HERE = ("config.json", INDEX_FILE, "pytorch_model.bin.index.json")
#: Bytes per element of each dtype an export writes.
ITEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def export_dtype(config: Any, dtype: str | None) -> str:
    """safetensors' dtype an export writes: ``dtype`` (``float32``, ``bfloat16``, ``float16``)
    or, for ``None``, the checkpoint's own (``config``'s ``torch_dtype``; float32 if none)."""
    return config_dtype(config) if dtype is None else stored_name(dtype, "export dtype")


def tensor_bytes(param: Any, dtype: str) -> int:
    """Bytes ``param`` takes in an export of ``dtype`` (a float parameter is written in it)."""
    is_float = str(param.dtype).lower().startswith(("float", "bfloat"))
    return int(param.size) * (ITEM_BYTES[dtype] if is_float else param.itemsize)


def written_here(split: SplitModel) -> list[tuple[str, Any]]:
    """``[(file name, Parameter)]`` this rank writes, in the model's parameter order."""
    names = split.checkpoint_names
    if names is None:
        raise ValueError("this SplitModel has no checkpoint names: make it with split_model or load_split")
    cells = [split.stages[s] for s in range(split.rank, len(split.stages), split.pp)]
    if split.rank == 0 and split.preprocess is not None:
        cells.append(split.preprocess)
    head_copy = split.tied_weights[1] if split.tied_weights else None
    mine = {id(p): p for cell in cells for p in cell.get_parameters() if p.name != head_copy}
    if split.rank == 0:
        mine.update({id(p): p for p in split.unplaced.values()})
    order = {name: k for k, name in enumerate(names)}
    unknown = sorted(p.name for p in mine.values() if p.name not in order)
    if unknown:
        raise ValueError(f"parameters {unknown[:5]} are not the model's: cannot name them in an export")
    return [(names[p.name], p) for p in sorted(mine.values(), key=lambda p: order[p.name])]


def shard_plan(sizes_by_rank: list[list[tuple[str, int]]], max_shard_size: int) -> list[list[list[str]]]:
    """Each rank's shards (lists of names), packed in order, a shard at most ``max_shard_size``
    bytes unless one tensor alone is larger; shards never cross ranks."""
    plan = []
    for sizes in sizes_by_rank:
        shards: list[list[str]] = []
        used = 0
        for name, size in sizes:
            if not shards or used + size > max_shard_size:
                shards.append([])
                used = 0
            shards[-1].append(name)
            used += size
        plan.append(shards)
    return plan


def shard_file(index: int, count: int) -> str:
    """Hugging Face's name of shard ``index`` (0-based) of ``count``."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def check_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """``out_dir`` as a path, or ``FileExistsError`` if it is not empty and not to be replaced."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise FileExistsError(
            f"export directory {str(out)!r} exists and is not empty: choose another, or pass overwrite=True "
            "(--overwrite)"
        )
    return out


def export_pretrained(
    split: SplitModel,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
    replica: int = 0,
    timeout_s: float = 300.0,
    dtype: str | None = None,
) -> Path:
    """Write ``split`` (this rank's share, every rank calling) as one ``save_pretrained``
    directory ``out_dir`` loadable by mindone's and PyTorch ``transformers``' ``from_pretrained``.

    Args:
        split: what :func:`graph_exec.models.load_split` returned on this rank (``split.rank``
            of ``split.pp``), or a whole-model :func:`split_model` on one process.
        out_dir: the directory to write; on a filesystem every rank of the pipeline sees.
        overwrite: replace a non-empty ``out_dir`` (else ``FileExistsError``, on every rank,
            before any rank communicates).
        max_shard_size: bytes per shard (a larger tensor is a shard of its own).
        replica: the data-parallel replica of this rank; only replica 0 writes, every rank of
            the job takes part in the exchanges.
        timeout_s: bound on each wait for the other ranks.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None`` (default): the
            checkpoint's own, its config's ``torch_dtype`` (float32 when it names none).

    Returns ``out_dir``. A failure on any rank raises ``RuntimeError`` naming it on every rank
    and leaves ``out_dir`` as it was.
    """
    out = check_out_dir(out_dir, overwrite)
    _check_export(split, max_shard_size)
    stored = export_dtype(split.config, dtype)
    writes = replica == 0
    mine = written_here(split) if writes else []
    exchange = _Exchange(timeout_s) if _Exchange.job_has_peers() else None
    sizes = [(name, tensor_bytes(p, stored)) for name, p in mine]
    digests = tied_digests(split) if writes else {}
    shared = (split.rank, writes, sizes, digests)
    everyone = exchange.gather(shared) if exchange else [shared]
    check_tied_equal(split.tied_weights, [(rank, held) for rank, wrote, _, held in everyone if wrote])
    writers = sorted((rank, entries) for rank, wrote, entries, _ in everyone if wrote)
    plan = shard_plan([entries for _, entries in writers], max_shard_size)
    count = sum(len(shards) for shards in plan)
    position = [rank for rank, _ in writers].index(split.rank) if writes else len(plan)
    first = sum(len(shards) for shards in plan[:position])  # the number of this rank's first shard
    lead = split.rank == 0 and writes
    temp = out.parent / f".{out.name}.exporting"
    if lead:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
    if exchange:
        exchange.gather(None)  # the temporary directory exists before anyone writes into it
    error, weight_map = (
        _write_shards(temp, plan[position], first, count, mine, stored) if writes else (None, {})
    )
    results = exchange.gather((split.rank, error, weight_map)) if exchange else [(0, error, weight_map)]
    failed = [(rank, text) for rank, text, _ in results if text]
    if not failed and lead:
        try:
            weights = {k: v for _, _, part in results for k, v in part.items()}
            finish(temp, out, split.config, split.family, weights, sizes_of(everyone), stored, split.source)
        except Exception as exc:
            failed = [(0, f"{type(exc).__name__}: {exc}")]
    if exchange:
        failed = exchange.gather(failed)[0]  # rank 0's verdict, on every rank
    if failed:
        if lead:
            shutil.rmtree(temp, ignore_errors=True)
        rank, text = failed[0]
        raise RuntimeError(f"export to {str(out)!r} failed on pipeline rank {rank}: {text}")
    return out


def _check_export(split: SplitModel, max_shard_size: int) -> None:
    """Refuse, before any rank communicates, a split without a config or a bad shard size."""
    if split.config is None:
        raise ValueError("this SplitModel has no config: make it with split_model or load_split")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")


def _write_shards(
    temp: Path, shards: list[list[str]], first: int, count: int, mine: list[tuple[str, Any]], stored: str
) -> tuple[str | None, dict[str, str]]:
    """Write this rank's ``shards`` (numbered from ``first`` of ``count``) into ``temp``: the
    error text (``None`` if all went well) and the weight map of what was written. An error is
    returned, not raised, so that every rank hears of it and none waits for a rank that failed."""
    weight_map: dict[str, str] = {}
    try:
        mine_by_name = dict(mine)
        for k, names in enumerate(shards):
            file = shard_file(first + k, count)
            weight_map.update(write_shard(temp, file, names, mine_by_name, dtype=stored))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", weight_map
    return None, weight_map


def sizes_of(everyone: list[tuple[int, bool, list[tuple[str, int]], Any]]) -> int:
    """Total bytes written, over every writing rank."""
    return sum(size for _, wrote, entries, _ in everyone if wrote for _, size in entries)


def tied_digests(split: SplitModel) -> dict[str, int]:
    """``{name: CRC-32 of its bytes}`` of the copies of the tied pair this rank holds."""
    if not split.tied_weights:
        return {}
    cells = [split.stages[s] for s in range(split.rank, len(split.stages), split.pp)]
    if split.rank == 0 and split.preprocess is not None:
        cells.append(split.preprocess)
    held = {p.name: p for cell in cells for p in cell.get_parameters() if p.name in split.tied_weights}
    return {name: zlib.crc32(np.ascontiguousarray(p.asnumpy()).tobytes()) for name, p in held.items()}


def check_tied_equal(pair: tuple[str, str] | None, held: list[tuple[int, dict[str, int]]]) -> None:
    """``ValueError`` (on every rank alike: they all see ``held``, pipeline rank -> digests)
    unless both copies of the tied ``pair`` hold the same bytes: the export writes the first only."""
    if not pair:
        return
    where = {name: (rank, digest) for rank, digests in held for name, digest in digests.items()}
    if all(name in where for name in pair) and where[pair[0]][1] != where[pair[1]][1]:
        raise ValueError(
            f"the tied copies {pair[0]!r} (pipeline rank {where[pair[0]][0]}) and {pair[1]!r} (pipeline "
            f"rank {where[pair[1]][0]}) hold different values, and an export writes only {pair[0]!r}: "
            "train them with tied_parameters=[...] and one optimizer setting for both"
        )


def write_shard(
    folder: Path, file: str, names: list[str], params: dict[str, Any], *, dtype: str = "F32"
) -> dict[str, str]:
    """Write one shard, its float tensors in safetensors dtype ``dtype`` (only its tensors are
    gathered into host memory), and return its entries."""
    tensors = {name: as_stored(params[name].asnumpy(), dtype) for name in names}
    write_safetensors(folder / file, tensors, {"format": "pt"})
    return dict.fromkeys(names, file)


def finish(
    temp: Path,
    out: Path,
    config: Any,
    family: str,
    weight_map: dict[str, str],
    total: int,
    dtype: str = "F32",
    source: Path | None = None,
) -> None:
    """The index, ``config.json`` (its ``torch_dtype`` the export's ``dtype``) and the files of
    ``source`` that are not weights into ``temp``, then the rename that makes it ``out``."""
    files = set(weight_map.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (temp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = copy.deepcopy(config)
    # At the top level, where from_pretrained looks: Qwen2VLConfig's __setattr__ would send a
    # key its text_config also has (architectures) to the text_config.
    vars(config)["architectures"] = [MODEL_CLASSES[family]]
    vars(config)["dtype"] = {v: k for k, v in FLOAT_NAMES.items()}[dtype]
    vars(config).pop("torch_dtype", None)
    config.save_pretrained(str(temp))
    if source is not None:
        copy_non_weights(Path(source), temp)
    old = out.parent / f".{out.name}.replaced"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(temp, out)
    shutil.rmtree(old, ignore_errors=True)


def copy_non_weights(source: Path, into: Path) -> list[str]:
    """Copy every file and folder of ``source`` that is not weights, an index or ``config.json``
    (tokenizer, processor, chat template, ``generation_config.json``, a README) into ``into``;
    returns their names."""
    copied = []
    for entry in sorted(source.iterdir()):
        if entry.name in WRITTEN_HERE or entry.name.endswith(WEIGHT_SUFFIXES) or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, into / entry.name)
        else:
            shutil.copy2(entry, into / entry.name)
        copied.append(entry.name)
    return copied


class _Exchange:
    """Small all-gathers of Python objects over every rank of the job, each bounded in time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    @staticmethod
    def job_has_peers() -> bool:
        """Whether other ranks take part: every rank of the job joins every exchange, also the
        replicas of a one-rank pipeline (deciding from ``split.pp`` and ``replica`` left replica
        0 of ``--dp 2`` alone while replica 1 waited for it)."""
        from graph_exec.transport.gather import world_size

        return world_size() > 1

    def gather(self, value: Any) -> list[Any]:
        from graph_exec.transport import all_gather_objects

        return all_gather_objects(value, self.timeout_s, "export_pretrained")
