"""Write a small random "pretrained" directory with MindSpore ONE's own ``save_pretrained``.

``python -m graph_exec.examples.make_pretrained --model llama|qwen2|qwen2vl --out DIR`` builds
the example's model from a random config (seeded; no network) and saves it the way a
downloaded Hugging Face checkpoint looks: ``config.json``, safetensors shards and their index
(``model.safetensors.index.json``), under Hugging Face's tensor names. The shard size defaults to a quarter of the model, so
there are several shards and a loader has to follow the index. ``qwen2`` ties its embedding
and head (the directory then holds no ``lm_head.weight``: the embedding is the only copy).

This is what ``graph-exec run llama|qwen2vl --pretrained DIR`` and
:func:`graph_exec.models.load_split` read, so the whole pretrained path can be tried offline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

MODELS = ("llama", "qwen2", "qwen2vl")


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
) -> Path:
    """Build model ``name`` (or from ``config``) with random weights from ``seed`` and save it
    into ``out`` with mindone's ``save_pretrained``; returns ``out``. ``max_shard_size`` in
    bytes (default: a quarter of the model, so that there are several shards)."""
    import mindspore as ms

    import graph_exec.models as gm
    from graph_exec.models.pretrained import torch_names

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    config = config_of(name, size, layers, vision_depth) if config is None else config
    ms.set_seed(seed)
    model = gm.model_class(config)(config)
    shard = max_shard_size or max(model_bytes(model) // 4, 1)
    # Hugging Face's names (mindone's own would keep an nn.Embedding's ``embedding_table``).
    params = {p.name: p for p in model.get_parameters()}
    state = {hf: params[name] for name, hf in torch_names(model).items()}
    model.save_pretrained(str(out), state_dict=state, max_shard_size=shard)
    return Path(out)


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
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--max-shard-size",
        type=int,
        metavar="BYTES",
        help="bytes per shard (default: a quarter of the model)",
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
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"wrote {args.model} ({args.size}) to {out}: config.json and {len(shards)} safetensors shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
