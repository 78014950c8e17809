"""``graph-exec run llama|qwen2vl --pretrained DIR --dataset FILE``: train on your conversations.

The flags, and the check of the data set *before* the launch: every conversation is prepared
once here with the directory's own processor (:class:`graph_exec.data.ConversationDataset`), so a
missing image, a tag without its image, a conversation without an assistant turn, a sample above
``--max-length`` or a tokenizer that does not fit the config is one error naming the file and
line, printed before any rank starts; ``--skip-bad-samples`` leaves those samples out instead
(each named in the log, their count printed). A sample above ``--max-length`` is refused unless
``--truncate`` cuts it to its first N tokens (never through an image's tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from graph_exec.cli.argtypes import positive_int

#: The examples that train on conversations (with ``--pretrained``).
DATASET_EXAMPLES = ("llama", "qwen2vl")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("your conversations (llama, qwen2vl; with --pretrained)")
    group.add_argument(
        "--dataset",
        metavar="FILE",
        type=Path,
        help="JSON or JSON lines of conversations ('messages'/'images' or 'conversations'/'image'), "
        "prepared by the --pretrained directory's own processor and chat template (docs/models.md)",
    )
    group.add_argument(
        "--image-root",
        metavar="DIR",
        type=Path,
        help="the folder image paths are relative to (default: the data file's folder)",
    )
    group.add_argument(
        "--max-length",
        metavar="N",
        type=positive_int,
        help="refuse (or skip, or with --truncate cut) samples above N tokens",
    )
    group.add_argument(
        "--truncate",
        action="store_true",
        help="cut samples above --max-length to their first N tokens (refused if the cut would split an "
        "image's tokens or leave no assistant token) instead of refusing them",
    )
    group.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pack several samples into each row of --max-length tokens, each attending only to itself, "
        "rows balanced by tower cost (docs/models.md, Packing); the loss is the same (default: --no-packing, "
        "each sample its own row)",
    )
    group.add_argument(
        "--skip-bad-samples",
        action="store_true",
        help="leave bad samples out (each named in the log, their count printed) instead of stopping",
    )


def dataset_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The ``model_options`` of ``--dataset`` (``{}`` without it, or for a command without
    the flags), once the whole data set has been prepared here; what cannot work exits with code
    2 before anything launches."""
    if not hasattr(args, "dataset"):
        return {}
    extra = [
        flag
        for flag, value in (
            ("--image-root", args.image_root),
            ("--max-length", args.max_length),
            ("--truncate", args.truncate),
            ("--skip-bad-samples", args.skip_bad_samples),
            ("--packing", args.packing),
        )
        if value
    ]
    if args.dataset is None:
        if extra:
            parser.error(f"{', '.join(extra)} need --dataset FILE")
        return {}
    if args.example not in DATASET_EXAMPLES:
        parser.error(f"--dataset needs one of {', '.join(DATASET_EXAMPLES)}, not {args.example}")
    if args.pretrained is None:
        parser.error(
            "--dataset needs --pretrained DIR: its tokenizer, chat template and processor prepare the data"
        )
    if getattr(args, "image_sizes", None) is not None or getattr(args, "images_per_sample", None) is not None:
        parser.error("--dataset brings its own images: drop --image-sizes and --images-per-sample")
    if not args.dataset.is_file():
        parser.error(f"--dataset {str(args.dataset)!r} is not a file")
    if args.image_root is not None and not args.image_root.is_dir():
        parser.error(f"--image-root {str(args.image_root)!r} is not a folder")
    if args.packing and args.max_length is None:
        parser.error("--packing needs --max-length N: the tokens of a packed row")
    if args.truncate and args.max_length is None:
        parser.error("--truncate needs --max-length N: the tokens it cuts samples to")
    options = {
        "dataset": str(args.dataset.resolve()),
        "image_root": str(args.image_root.resolve()) if args.image_root else None,
        "max_length": args.max_length,
        "skip_bad_samples": args.skip_bad_samples,
    } | ({"truncate": True} if args.truncate else {})
    _check(options, str(args.pretrained.resolve()), parser)
    return options | ({"packing": True} if args.packing else {})


def _check(options: dict, model_dir: str, parser: argparse.ArgumentParser) -> None:
    """Prepare every sample once (as each rank will), exiting with the first error."""
    from graph_exec.data import ConversationDataset, DataError

    try:
        data = ConversationDataset(
            options["dataset"],
            model_dir,
            image_root=options["image_root"],
            max_length=options["max_length"],
            truncate=options.get("truncate", False),
            skip_bad_samples=options["skip_bad_samples"],
        )
        if not options["skip_bad_samples"]:
            for index in range(len(data)):
                data[index]
    except DataError as exc:
        parser.error(f"--dataset: {exc}")
    skipped = f", {len(data.skipped)} bad sample(s) skipped (named above)" if data.skipped else ""
    print(f"--dataset {options['dataset']}: {len(data)} conversations{skipped}", flush=True)
