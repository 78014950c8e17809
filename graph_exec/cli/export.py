"""``graph-exec export CHECKPOINT_DIR --config-from DIR --out DIR``: one pretrained directory from
the per-rank checkpoints of a run, offline (one process, no msrun).

See :mod:`graph_exec.models.export_offline`. Exits with code 2 for arguments that cannot work
(no such checkpoint directory, no ``config.json`` in ``--config-from``, a non-empty ``--out``
without ``--overwrite``), with 1 and the reason for a checkpoint that does not fit the config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graph_exec.cli.argtypes import non_negative_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a pretrained (save_pretrained) directory from a run's checkpoints",
        description="Merge the per-rank checkpoints of one step into one Hugging Face-format directory "
        "(config.json, safetensors shards, index) that mindone's and PyTorch transformers' from_pretrained "
        "load, in the checkpoint's own dtype, with the files of --config-from that are not weights "
        "(tokenizer, processor, chat template, generation config). Offline: no msrun.",
    )
    parser.add_argument(
        "checkpoint_dir", metavar="CHECKPOINT_DIR", type=Path, help="--checkpoint-dir of the run"
    )
    parser.add_argument(
        "--step",
        metavar="K",
        type=non_negative_int,
        help="the checkpoint step (default: the latest complete)",
    )
    parser.add_argument(
        "--config-from",
        metavar="DIR",
        type=Path,
        required=True,
        help="the pretrained directory the run started from",
    )
    parser.add_argument("--out", metavar="DIR", type=Path, required=True, help="the directory to write")
    parser.add_argument(
        "--export-dtype",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the exported weights (default: the checkpoint's own, --config-from's torch_dtype)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.set_defaults(func=lambda args: _export(args, parser))


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.checkpoint_dir.is_dir():
        parser.error(f"CHECKPOINT_DIR {str(args.checkpoint_dir)!r} is not a directory")
    if not (args.config_from / "config.json").is_file():
        parser.error(f"--config-from {str(args.config_from)!r} has no config.json")
    out = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        parser.error(
            f"--out {str(out)!r} exists and is not empty: choose another directory or pass --overwrite"
        )
    from graph_exec.models.export_offline import export_checkpoint

    try:
        written = export_checkpoint(
            args.checkpoint_dir,
            args.config_from,
            out,
            step=args.step,
            overwrite=args.overwrite,
            dtype=args.export_dtype,
        )
    except (ValueError, TypeError) as exc:
        print(f"graph-exec export: {exc}", file=sys.stderr)
        return 1
    shards = len(list(written.glob("*.safetensors")))
    carried = sorted(
        p.name for p in written.iterdir() if p.name != "config.json" and "safetensors" not in p.name
    )
    also = f", and from --config-from: {', '.join(carried)}" if carried else ""
    print(f"exported to {written}: config.json and {shards} safetensors shard(s){also}")
    return 0
