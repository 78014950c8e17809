"""Write a small random "pretrained" directory with MindSpore ONE's own ``save_pretrained``.

``python -m graph_exec.examples.make_pretrained --model llama|qwen2|qwen2vl --out DIR
[--dtype bfloat16|float32]`` builds the example's model from a random config (seeded; no
network) and saves it the way a downloaded Hugging Face checkpoint looks: ``config.json``
(``torch_dtype``), safetensors shards in **BF16** by default (``format: pt`` metadata) and their
index (``model.safetensors.index.json``), under Hugging Face's tensor names: two shards of
about equal bytes unless ``--max-shard-size`` says otherwise, so a loader has to follow the
index. ``qwen2`` ties its embedding and head (the directory then holds no ``lm_head.weight``:
the embedding is the only copy). The weights are saved by mindone's ``save_pretrained`` in
float32, then rewritten in BF16 (rounded to nearest even) and two shards, as PyTorch
``transformers`` writes a bfloat16 model: mindone's writer goes through numpy, which has no
bfloat16.

This is what ``graph-exec run llama|qwen2vl --pretrained DIR`` and
:func:`graph_exec.models.load_split` read, so the whole pretrained path can be tried offline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

MODELS = ("llama", "qwen2", "qwen2vl")
DTYPES = ("bfloat16", "float32")


def config_of(name: str, size: str = "tiny", layers: int | None = None, vision_depth: int | None = None):
    """The random config ``make_pretrained`` saves for model ``name`` (a transformers config)."""
    from graph_exec.examples import llama, qwen2vl

    if name == "qwen2vl":
        preset = qwen2vl.SIZES[size]
        depth = preset.vision_depth if vision_depth is None else vision_depth
        return qwen2vl.config(preset, layers or preset.layers, depth)
    preset = llama.SIZES[size]
    if name == "qwen2":
        return llama.config(preset, layers or preset.layers, tie_word_embeddings=True, family="qwen2")
    return llama.config(preset, layers or preset.layers)


def model_bytes(model: Any) -> int:
    """Bytes of the model's parameters, each once (a tied pair counts once)."""
    seen = {id(p): p for p in model.get_parameters()}
    return sum(int(p.size) * p.itemsize for p in seen.values())


def make_pretrained(
    name: str,
    out: str | Path,
    *,
    size: str = "tiny",
    layers: int | None = None,
    vision_depth: int | None = None,
    seed: int = 0,
    max_shard_size: int | None = None,
    config: Any = None,
    dtype: str = "bfloat16",
) -> Path:
    """Build model ``name`` (or from ``config``) with random weights from ``seed`` and save it
    into ``out`` with mindone's ``save_pretrained`` in ``dtype`` (``bfloat16``: the Hub's;
    ``float32``); returns ``out``. ``max_shard_size`` in bytes of float32 (mindone's
    sharding; default: two shards of about equal bytes)."""
    import mindspore as ms

    import graph_exec.models as gm
    from graph_exec.examples.assets import write_tokenizer_and_processor
    from graph_exec.models.pretrained import torch_names

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = config_of(name, size, layers, vision_depth) if config is None else config
    ms.set_seed(seed)
    model = gm.model_class(config)(config)
    shard = max_shard_size or model_bytes(model)
    # Hugging Face's names (mindone's own would keep an nn.Embedding's ``embedding_table``).
    params = {p.name: p for p in model.get_parameters()}
    state = {hf: params[name] for name, hf in torch_names(model).items()}
    model.save_pretrained(str(out), state_dict=state, max_shard_size=shard)
    set_dtype(Path(out), dtype, None if max_shard_size else 2)
    write_tokenizer_and_processor(Path(out), config)  # what a Hub directory carries beside its weights
    return Path(out)


def set_dtype(folder: Path, dtype: str, shards: int | None = None) -> None:
    """Rewrite the weights of ``folder`` with their float tensors in ``dtype`` and ``format: pt``
    metadata, in ``shards`` shards of about equal bytes (``None``: as they were), the index and
    ``config.json``'s ``torch_dtype`` to match. Holds every tensor at once: for small examples."""
    import json

    from graph_exec.hub.directory import INDEX_FILE, SINGLE_FILE, PretrainedDirectory
    from graph_exec.hub.dtypes import FLOAT_NAMES, as_stored, write_safetensors

    weights = PretrainedDirectory(folder)
    tensors = {name: as_stored(weights.read(name), FLOAT_NAMES[dtype]) for name in weights.tensors}
    groups = _groups(tensors, shards) if shards else _files_of(weights)
    for file in {file for file, _, _ in weights.tensors.values()}:
        (folder / file).unlink()
    (folder / INDEX_FILE).unlink(missing_ok=True)
    weight_map = {}
    for k, names in enumerate(groups):
        file = SINGLE_FILE if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(folder / file, {name: tensors[name] for name in names}, {"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(groups) > 1:
        total = sum(array.nbytes for _, array in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("dtype", None)  # transformers 4.57's name; the Hub's files say torch_dtype
    config["torch_dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _groups(tensors: dict[str, tuple[str, Any]], count: int) -> list[list[str]]:
    """The names, in order, cut into ``count`` runs of about equal bytes (none empty)."""
    total = sum(array.nbytes for _, array in tensors.values())
    groups: list[list[str]] = [[] for _ in range(count)]
    used = 0
    for name, (_, array) in tensors.items():
        groups[min(used * count // max(total, 1), count - 1)].append(name)
        used += array.nbytes
    return [group for group in groups if group]


def _files_of(weights: Any) -> list[list[str]]:
    """The names of each file of ``weights``, as they were."""
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in weights.tensors.items():
        by_file.setdefault(file, []).append(name)
    return [by_file[file] for file in sorted(by_file)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graph_exec.examples.make_pretrained",
        description="Write a small random pretrained directory (config.json, safetensors shards, index) "
        "with mindone's save_pretrained, offline.",
    )
    parser.add_argument("--model", choices=MODELS, required=True, help="the model family")
    parser.add_argument("--out", required=True, type=Path, help="the directory to write (must not exist)")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny", help="preset (default tiny)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="dtype of the weights (default bfloat16, the Hub's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--max-shard-size",
        type=int,
        metavar="BYTES",
        help="bytes of float32 per shard, mindone's sharding (default: two shards of about equal bytes)",
    )
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {str(args.out)!r} exists and is not empty; choose a new directory")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    out = make_pretrained(
        args.model,
        args.out,
        size=args.size,
        layers=args.layers,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    print(
        f"wrote {args.model} ({args.size}, {args.dtype}) to {out}: config.json and {len(shards)} "
        "safetensors shard(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
