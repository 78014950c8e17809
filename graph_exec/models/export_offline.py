"""Export a pretrained directory offline, from the per-rank checkpoints ``save_checkpoint`` wrote.

``graph-exec export CHECKPOINT_DIR [--step K] --config-from DIR --out DIR`` runs in one
process, with no ``msrun``. A checkpoint step holds one MindSpore ``.ckpt`` per rank: the rank's
chunk parameters, its replica of the preprocess, and optimizer and scaler state (see
:mod:`graph_exec.checkpoint.state`). The model's parameter names come from a skeleton built
from the config (``mindspore.nn.utils.no_init_parameters``: no data); each is taken from the
first rank file that holds it (the replicated preprocess from rank 0; the head copy of a
tied pair is left out, as the embedding is the one tied tensor), and the buffers no rank holds
(Qwen2-VL's rotary ``inv_freq``) from the skeleton, which computes them from the config.

Streaming: one rank file is loaded at a time, and only its model parameters
(``load_checkpoint``'s ``choice_func``); its tensors go to shards of at most
``max_shard_size`` bytes, written one at a time. The shards are numbered when every one is
written, then the directory is renamed into place as :func:`export_pretrained` does.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from graph_exec.models.export import (
    DEFAULT_SHARD_BYTES,
    check_out_dir,
    export_dtype,
    finish,
    shard_file,
    tensor_bytes,
    write_shard,
)
from graph_exec.models.pretrained import checkpoint_names, load_config, model_class, model_type_of


def chosen_step(directory: Path, step: int | None) -> tuple[int, dict[str, Any]]:
    """``(step, manifest)`` of ``step`` or of the latest complete one; ``ValueError`` else."""
    from graph_exec.checkpoint import layout

    complete = layout.complete_steps(directory)
    if not complete:
        raise ValueError(f"{str(directory)!r} holds no complete checkpoint")
    chosen = complete[-1] if step is None else step
    manifest, why = layout.check_step(directory, chosen)
    if manifest is None:
        raise ValueError(
            f"checkpoint step {chosen} in {str(directory)!r} is not complete: {why}; complete: {complete}"
        )
    return chosen, manifest


def export_checkpoint(
    checkpoint_dir: str | Path,
    config_from: str | Path,
    out_dir: str | Path,
    *,
    step: int | None = None,
    overwrite: bool = False,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
    dtype: str | None = None,
) -> Path:
    """Write checkpoint ``step`` (default: the latest complete) of ``checkpoint_dir`` as one
    ``save_pretrained`` directory ``out_dir``, with the config of the pretrained directory
    ``config_from`` and its files that are not weights (tokenizer, processor, chat template), in
    ``dtype`` (``float32``, ``bfloat16``, ``float16``; default the checkpoint's own, its
    ``torch_dtype``). Raises ``FileExistsError`` for a non-empty ``out_dir`` without
    ``overwrite``, ``ValueError`` for no complete step, a rank file whose checksum differs from
    the manifest, or a parameter the checkpoint lacks or holds with another shape."""
    from mindspore.nn.utils import no_init_parameters

    from graph_exec.checkpoint import layout

    out = check_out_dir(out_dir, overwrite)
    folder = Path(checkpoint_dir)
    chosen, manifest = chosen_step(folder, step)
    config = load_config(config_from)
    stored = export_dtype(config, dtype)
    cls = model_class(config)
    with no_init_parameters():
        skeleton = cls(config)
    names = {name: hf[0] for name, hf in checkpoint_names(skeleton).items()}  # a tied pair once
    params = {p.name: p for p in skeleton.get_parameters()}
    where = layout.step_dir(folder, chosen)
    entries = sorted(manifest["ranks"], key=lambda e: e["rank"])
    for entry in entries:
        if layout.sha256_of(where / entry["file"]) != entry["sha256"]:
            raise ValueError(f"{where / entry['file']} does not match its checksum in the manifest: corrupt")
    temp = out.parent / f".{out.name}.exporting"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        parts: list[dict[str, str]] = []  # per part file: {file name: part file}
        written: set[str] = set()
        for entry in entries:
            loaded = _model_tensors(where / entry["file"], names, params, written)
            tensors = {names[n]: t for n, t in loaded.items()}
            parts += _write_parts(temp, len(parts), tensors, max_shard_size, stored)
            written |= set(loaded)
        unheld = [name for name in names if name not in written]
        missing = [name for name in unheld if params[name].has_init]  # not a buffer computed from the config
        if missing:
            raise ValueError(
                f"checkpoint step {chosen} lacks {len(missing)} parameter(s) of the model: {missing[:5]}"
            )
        if unheld:
            parts += _write_parts(
                temp, len(parts), {names[n]: params[n] for n in unheld}, max_shard_size, stored
            )
        weight_map = {}
        for k, part in enumerate(parts):
            final = shard_file(k, len(parts))
            (temp / next(iter(part.values()))).rename(temp / final)
            weight_map.update(dict.fromkeys(part, final))
        total = sum((temp / f).stat().st_size for f in set(weight_map.values()))
        finish(temp, out, config, model_type_of(config), weight_map, total, stored, Path(config_from))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out


def _model_tensors(
    path: Path, names: dict[str, str], params: dict[str, Any], written: set[str]
) -> dict[str, Any]:
    """``{parameter name: tensor}`` of the model parameters in rank file ``path`` not yet written
    (only those are loaded), in the model's order; ``ValueError`` for a shape that differs."""
    import mindspore as ms

    loaded = ms.load_checkpoint(str(path), choice_func=lambda name: name in names and name not in written)
    wrong = [
        f"{n}: {list(t.shape)} here, {list(params[n].shape)} from the config"
        for n, t in loaded.items()
        if tuple(t.shape) != tuple(params[n].shape)
    ]
    if wrong:
        raise ValueError(f"{path} holds tensors whose shape differs from the config: {'; '.join(wrong[:3])}")
    return {n: loaded[n] for n in names if n in loaded}


def _write_parts(
    temp: Path, first: int, tensors: dict[str, Any], max_shard_size: int, dtype: str
) -> list[dict[str, str]]:
    """``tensors`` into part files ``.part-K`` (K from ``first``) of at most ``max_shard_size``
    bytes, in safetensors dtype ``dtype``; returns each part's ``{name: part file}``."""
    parts: list[dict[str, str]] = []
    batch: list[str] = []
    used = 0
    for name, tensor in tensors.items():
        size = tensor_bytes(tensor, dtype)
        if batch and used + size > max_shard_size:
            parts.append(write_shard(temp, f".part-{first + len(parts)}", batch, tensors, dtype=dtype))
            batch, used = [], 0
        batch.append(name)
        used += size
    if batch:
        parts.append(write_shard(temp, f".part-{first + len(parts)}", batch, tensors, dtype=dtype))
    return parts
