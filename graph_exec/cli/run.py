"""``graph-exec run EXAMPLE``: train an example model pipelined over local ranks.

Launches msrun itself (loopback, a free port), trains with Adam, prints one progress line per
step while training runs and a summary at the end; ``--trace`` and ``--plot`` show what every
rank really ran. Compute steps are timed to their completion (``sync_steps``), so the timeline
shows each step's own duration; on CPU that was measured faster too (see ``RankRuntime``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from graph_exec import device
from graph_exec.cli.argtypes import (
    bucket_sizes,
    count_range,
    image_sizes,
    layer_counts,
    length_range,
    non_negative_int,
    positive_int,
)
from graph_exec.cli.conversations import add_dataset_arguments, dataset_options
from graph_exec.cli.jobs import (
    JobFailed,
    Restarts,
    add_launch_arguments,
    checked_job,
    execute,
    log_directory,
    nodes_of,
    output_file,
    run_directory,
)
from graph_exec.cli.resume import ResumePoint, ResumeRefused, choose, expected_facts, set_aside
from graph_exec.device import DevicePolicy, fast_paths_requested
from graph_exec.replan import ReplanError, layout, plan_on, plan_on_fewer
from graph_exec.report.analysis import summarize
from graph_exec.report.job import JobSpec, RunSpec
from graph_exec.report.memory import memory_lines
from graph_exec.report.records import read_run
from graph_exec.report.trace import PLOT_EXTRA_HINT, chrome_trace, plot_timeline
from graph_exec.restarts import Attempt
from graph_exec.schedule.config import BACKWARD, BODY, RUN_AHEAD

SIZES = ("tiny", "small")


#: ``--size`` unless told.
DEFAULT_SIZE = "tiny"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared with ``graph-exec bench``."""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--ranks", metavar="N", type=positive_int, default=2, help="ranks in all, on all nodes (default 2)"
    )
    group.add_argument(
        "--dp",
        metavar="D",
        type=positive_int,
        default=1,
        help="pipeline replicas trained data-parallel, each on N/D ranks (default 1: one pipeline)",
    )
    group.add_argument(
        "--vpp", metavar="V", type=positive_int, default=2, help="model chunks per rank (default 2)"
    )
    group.add_argument(
        "--micro",
        metavar="M",
        type=positive_int,
        help="micro-batches per step of each replica (default 2 x pipeline ranks)",
    )
    group.add_argument(
        "--batch",
        metavar="B",
        type=positive_int,
        help="samples per step over all replicas, a multiple of D x M (default 2 x D x M)",
    )
    group.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE, help="model size preset (default tiny)")
    group.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")


def workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, int]:
    """``(micro, batch)`` with their defaults filled in; an impossible set exits with code 2."""
    if args.ranks % args.dp:
        parser.error(
            f"--dp {args.dp} does not divide --ranks {args.ranks}: every pipeline replica needs the same "
            f"number of ranks; use a --dp among {[d for d in range(1, args.ranks + 1) if args.ranks % d == 0]}"
        )
    micro = args.micro or 2 * (args.ranks // args.dp)
    batch = args.batch or 2 * micro * args.dp
    if batch % (micro * args.dp):
        of = f"--dp {args.dp} x --micro {micro}" if args.dp > 1 else f"--micro {micro}"
        parser.error(f"--batch {batch} is not a multiple of {of}: every micro-batch needs equal rows")
    return micro, batch


def register(subparsers: argparse._SubParsersAction) -> None:
    from graph_exec.examples import EXAMPLES

    parser = subparsers.add_parser(
        "run",
        help="train an example model pipelined over local ranks",
        description="Launch msrun on this machine and train an example with the MPipe Transpose "
        "schedule (or the fair baseline without transposition), printing progress and a summary.",
    )
    parser.add_argument("example", choices=tuple(EXAMPLES), help="the example model")
    add_model_arguments(parser)
    _add_schedule_arguments(parser)
    _add_shape_arguments(parser)
    _add_image_arguments(parser)
    _add_data_arguments(parser)
    _add_output_arguments(parser)
    _add_checkpoint_arguments(parser)
    _add_pretrained_arguments(parser)
    add_dataset_arguments(parser)
    add_launch_arguments(parser, timeout_s=300)
    parser.set_defaults(func=lambda args: _run(args, parser))


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("schedule")
    group.add_argument(
        "--mode", choices=("graph", "pynative"), default="graph", help="executor (default graph)"
    )
    group.add_argument(
        "--steps",
        metavar="K",
        type=non_negative_int,
        default=8,
        help="training steps (default 8; 0 with --export: load then export, a round trip)",
    )
    group.add_argument(
        "--run-ahead",
        "--overflow",
        dest="run_ahead",
        choices=RUN_AHEAD,
        help="how far the transposed preprocess runs ahead: micro-batches beyond NT spread over the "
        "owners (full, the default) or inline on rank 0 (min); --overflow is its old name",
    )
    group.add_argument("--backward", choices=BACKWARD, help="preprocess backward (default central)")
    group.add_argument(
        "--body",
        choices=BODY,
        default="interleaved",
        help="pipeline body (default interleaved; zb: zero bubble)",
    )
    group.add_argument(
        "--zero",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: ZeRO-1, each of the --dp replicas keeps the Adam state of its share of the parameters "
        "(needs --dp 2 or more; default 0: every replica keeps all of it)",
    )
    group.add_argument(
        "--keep-preprocess-tape",
        action="store_true",
        help="trainable preprocess: keep the tape of each TFWD whose backward runs on the same rank "
        "instead of recomputing it (more memory, less compute; see ScheduleMPipeTranspose)",
    )
    train = group.add_mutually_exclusive_group()
    train.add_argument(
        "--frozen", dest="trainable", action="store_false", help="freeze the preprocess (vl_tower's default)"
    )
    train.add_argument(
        "--trainable", dest="trainable", action="store_true", help="train the preprocess (embed_lm's default)"
    )
    parser.set_defaults(trainable=None)
    group.add_argument(
        "--layers",
        metavar="N1,N2,...",
        type=layer_counts,
        help="blocks per stage, one count per stage (P x V), summing to the model's blocks: a "
        "rebalanced split (default: as even as possible)",
    )
    group.add_argument(
        "--baseline",
        action="store_true",
        help="the fair baseline: interleaved 1F1B with the same preprocess run on rank 0 right before "
        "F 0.m, nothing transposed (what MPipe is measured against)",
    )


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    shapes = parser.add_argument_group("shapes (embed_lm)")
    shapes.add_argument(
        "--seq-len-range",
        metavar="MIN,MAX",
        type=length_range,
        help="draw each step's sequence length uniformly from MIN..MAX (default: the example's 32)",
    )
    shapes.add_argument(
        "--shapes",
        choices=("static", "buckets", "dynamic"),
        default="static",
        help="static: every new length compiles its kernels; buckets: pad up to the next of "
        "--shape-buckets and mask the loss; dynamic: MindSpore dynamic-shape graphs (default static)",
    )
    shapes.add_argument(
        "--shape-buckets",
        metavar="S1,S2,...",
        type=bucket_sizes,
        help="bucket sizes of the sequence dim for --shapes buckets (default: 4 even steps up to MAX)",
    )


def _add_image_arguments(parser: argparse.ArgumentParser) -> None:
    images = parser.add_argument_group("images (qwen2vl): real samples of mixed images, padded with a mask")
    images.add_argument(
        "--image-sizes",
        metavar="HxW,...",
        type=image_sizes,
        help="image sizes in pixels, each drawn per image from a generator seeded by the step "
        "(multiples of patch x merge = 8; default the preset's one size)",
    )
    images.add_argument(
        "--images-per-sample",
        metavar="LO-HI",
        type=count_range,
        help="images per sample, drawn per sample in LO..HI (e.g. 0-2; default 1)",
    )


def image_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The ``model_options`` of ``--image-sizes`` / ``--images-per-sample`` (``{}`` without
    them); a value the qwen2vl preset cannot take exits with code 2 before anything launches."""
    if args.image_sizes is None and args.images_per_sample is None:
        return {}
    if args.example != "qwen2vl":
        parser.error(f"--image-sizes and --images-per-sample need the qwen2vl example, not {args.example}")
    from graph_exec.examples.qwen2vl import MAX_IMAGES
    from graph_exec.examples.qwen2vl import SIZES as PRESETS

    preset = PRESETS[args.size]
    unit = preset.patch * preset.merge
    sizes = args.image_sizes or ((preset.image, preset.image),)
    bad = [f"{h}x{w}" for h, w in sizes if h % unit or w % unit]
    if bad:
        parser.error(
            f"--image-sizes {','.join(bad)}: every size must be a multiple of patch x merge = {unit} "
            f"pixels on both sides (the {args.size} preset; e.g. {unit}x{unit},{2 * unit}x{unit})"
        )
    low, high = args.images_per_sample or (1, 1)
    if high > MAX_IMAGES:
        parser.error(f"--images-per-sample {low}-{high}: at most {MAX_IMAGES} images per sample")
    return {"image_sizes": [list(s) for s in sizes], "images_per_sample": [low, high]}


#: ``--data``: the example's batch of each step index, or its samples through graph_exec.data.
DATA = ("steps", "shuffled")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        choices=DATA,
        default="steps",
        help="steps: the example's own batch of each step (default); shuffled: a fixed set of the example's "
        "samples (3 global batches) read through graph_exec.data.DataLoader, each replica its shard, "
        "reshuffled every epoch, its position saved with every checkpoint (a resumed or restarted run "
        "continues with exactly the next batch)",
    )


def data_option(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The job's ``data``; ``--data shuffled`` with a length drawn per step exits with code 2."""
    if args.data == "shuffled" and args.seq_len_range is not None:
        parser.error(
            "--data shuffled reads a fixed set of samples of one length: it cannot take --seq-len-range "
            "(a length drawn per step); drop one of them"
        )
    return args.data


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument(
        "--trace", metavar="FILE", type=output_file, help="write every rank's timeline (chrome trace)"
    )
    out.add_argument("--plot", metavar="FILE.png", type=output_file, help="draw the last step of every rank")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group(
        "checkpoints",
        "one directory shared by every host (a shared filesystem with --nodes > 1): each "
        "checkpoint's completeness is checked by one rank, which must see every rank's file",
    )
    ckpt.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        type=log_directory,
        help="save checkpoints here (DIR/step_<k>/); one is always written after the last step",
    )
    ckpt.add_argument(
        "--save-every", metavar="N", type=positive_int, help="also save a checkpoint every N steps"
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir whose files match their "
        "checksums (a corrupt latest one is skipped for the previous one; from step 0 if there is none)",
    )
    ckpt.add_argument(
        "--resume-step",
        metavar="K",
        type=non_negative_int,
        help="continue from complete checkpoint step K instead of the latest (newer steps are set aside "
        "as DIR/step_<k>.superseded: the job writes them again)",
    )
    ckpt.add_argument(
        "--max-restarts",
        metavar="N",
        type=non_negative_int,
        default=0,
        help="when a rank dies or times out, relaunch the job from the latest complete checkpoint, at "
        "most N times (needs --checkpoint-dir; default 0)",
    )
    ckpt.add_argument(
        "--min-ranks",
        metavar="N",
        type=positive_int,
        help="with --max-restarts: when a relaunch finds fewer usable ranks than --ranks (a lost device), "
        "go on with at least N, re-planned with the same stage count P x V, split and global batch (the "
        "checkpoint loads by name); default: such a relaunch is not made",
    )


def _add_pretrained_arguments(parser: argparse.ArgumentParser) -> None:
    pretrained = parser.add_argument_group("pretrained weights (llama, qwen2vl)")
    pretrained.add_argument(
        "--pretrained",
        metavar="DIR",
        type=Path,
        help="start from this save_pretrained directory (each rank reads only its own share)",
    )
    pretrained.add_argument(
        "--export",
        metavar="DIR",
        type=Path,
        help="after the last step, write the model here (save_pretrained)",
    )
    pretrained.add_argument(
        "--export-dtype",
        choices=EXPORT_DTYPES,
        help="dtype of the exported weights (default: the checkpoint's own, its config's torch_dtype)",
    )
    pretrained.add_argument("--overwrite", action="store_true", help="let --export replace a non-empty DIR")


#: The examples that load and export pretrained directories, and the model types each takes.
PRETRAINED_EXAMPLES = {"llama": ("llama", "qwen2"), "qwen2vl": ("qwen2_vl",)}
#: ``--export-dtype``'s choices (``graph_exec.hub.dtypes.FLOAT_NAMES``, without importing it).
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def pretrained_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The job's ``model_options`` and export fields for ``--pretrained``/``--export``; a flag
    that cannot work exits with code 2 before anything launches."""
    wanted = args.pretrained is not None or args.export is not None
    if wanted and args.example not in PRETRAINED_EXAMPLES:
        parser.error(
            f"--pretrained and --export need one of {', '.join(PRETRAINED_EXAMPLES)}, not {args.example}"
        )
    if args.steps == 0 and args.export is None:
        parser.error("--steps 0 trains nothing: it needs --export DIR (load, then export)")
    if args.pretrained is not None:
        check_pretrained(args, parser)
    if args.export_dtype is not None and args.export is None:
        parser.error("--export-dtype needs --export DIR")
    out = args.export
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        parser.error(
            f"--export {str(out)!r} exists and is not empty: choose another directory or pass --overwrite"
        )
    return {
        "model_options": {"pretrained": str(args.pretrained.resolve())} if args.pretrained else None,
        "export_dir": str(out.resolve()) if out is not None else None,
        "export_overwrite": args.overwrite,
        "export_dtype": args.export_dtype,
    }


def check_pretrained(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Before the launch, what can be checked without MindSpore (:func:`graph_exec.hub.directory.
    check_directory`: the config's model type, the shards, the index, the dtypes); exits with
    code 2 naming what is wrong. ``--size`` with ``--pretrained`` is said to size nothing."""
    from graph_exec.hub.directory import check_directory

    try:
        check_directory(args.pretrained, PRETRAINED_EXAMPLES[args.example])
    except (OSError, ValueError) as exc:
        parser.error(f"--pretrained: {exc}")
    if args.size != DEFAULT_SIZE:
        batches = "sequence length" if args.example == "llama" else "images and special tokens"
        print(
            f"graph-exec run: --size {args.size} does not size the model with --pretrained (its config.json "
            f"does); it picks only the synthetic batches' {batches}",
            file=sys.stderr,
        )


def first_step(args: argparse.Namespace, parser: argparse.ArgumentParser, job: JobSpec) -> ResumePoint:
    """Where this run starts: with ``--resume`` the latest usable checkpoint, with
    ``--resume-step K`` step K, else 0 (see :mod:`graph_exec.cli.resume`).

    Checkpoint flags that cannot work exit with code 2 before anything launches: ``--save-every``,
    ``--resume``, ``--resume-step`` or ``--max-restarts`` without a directory, ``--max-restarts``
    on several hosts, a directory that already holds checkpoints without ``--resume`` (saving
    older steps next to them would be refused mid-run), a step that is not complete or is
    corrupt, or one written by a job set up differently (``job``: this one, before its steps
    are known).
    """
    folder = args.checkpoint_dir
    if args.min_ranks is not None and not args.max_restarts:
        parser.error(f"--min-ranks {args.min_ranks} needs --max-restarts N: it says how a relaunch may go on")
    if folder is None:
        if args.max_restarts:
            parser.error(
                f"--max-restarts {args.max_restarts} needs --checkpoint-dir DIR: a restart resumes from "
                "the latest checkpoint there (add --save-every N to lose at most N steps)"
            )
        if args.save_every or args.resume or args.resume_step is not None:
            parser.error("--save-every, --resume and --resume-step need --checkpoint-dir DIR")
        return ResumePoint(0)
    if args.max_restarts and args.nodes > 1:
        parser.error(
            f"--max-restarts needs a job on one host, not --nodes {args.nodes}: the launchers of several "
            "hosts cannot agree on a relaunch; restart a multi-host job with --resume"
        )
    check_min_ranks(args, parser, job)
    try:
        return choose(
            folder,
            resume=args.resume,
            resume_step=args.resume_step,
            expected=expected_facts(job),
            data=job.data,
        )
    except ResumeRefused as refused:
        parser.error(str(refused))


def check_min_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser, job: JobSpec) -> None:
    """``--min-ranks N``: at most ``--ranks``, and a count that a plan of the job's stage count
    and global batch fits (so that a relaunch on any count from N up has a plan); else exit 2."""
    if args.min_ranks is None:
        return
    if args.min_ranks > job.ranks:
        parser.error(
            f"--min-ranks {args.min_ranks} is above --ranks {job.ranks}: it is the fewest ranks a relaunch "
            f"may go on with; use 1..{job.ranks}"
        )
    fits = [n for n in range(1, job.ranks + 1) if _fits(job, n)]
    if args.min_ranks not in fits:
        parser.error(
            f"--min-ranks {args.min_ranks}: no plan of this job's {job.pp * job.vpp} stages (P x V) and global "
            f"batch {job.batch} fits {args.min_ranks} ranks; rank counts that fit: {fits}"
        )


def _fits(job: JobSpec, ranks: int) -> bool:
    try:
        plan_on(job, ranks)
    except ReplanError:
        return False
    return True


#: The examples whose ``build`` takes ``layers=`` (blocks per stage: ``--layers``).
LAYERS_EXAMPLES = ("embed_lm", "llama", "qwen2vl")
#: The examples whose batches take a sequence length (and whose loss has a masked form).
LENGTH_EXAMPLES = ("embed_lm",)


def shape_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The job's ``seq_len_range``, ``shapes`` and ``shape_buckets``; impossible sets exit with 2."""
    mixed = (
        getattr(args, "image_sizes", None) is not None
        or getattr(args, "images_per_sample", None) is not None
        or getattr(args, "dataset", None) is not None
    )
    if mixed and args.shapes == "dynamic" and args.shape_buckets is None and args.seq_len_range is None:
        # qwen2vl's mixed batches vary their patch count and length: one dynamic graph per kernel
        return {"seq_len_range": None, "shapes": "dynamic", "shape_buckets": None}
    varied = args.seq_len_range is not None or args.shapes != "static" or args.shape_buckets is not None
    if varied and args.example not in LENGTH_EXAMPLES:
        parser.error(
            f"--seq-len-range, --shapes and --shape-buckets need an example with a sequence length "
            f"({', '.join(LENGTH_EXAMPLES)}), not {args.example}"
        )
    if args.shape_buckets is not None and args.shapes != "buckets":
        parser.error("--shape-buckets needs --shapes buckets")
    longest = args.seq_len_range[1] if args.seq_len_range else 32
    buckets = args.shape_buckets
    if args.shapes == "buckets" and buckets is None:
        buckets = tuple(sorted({max(1, -(-longest * k // 4)) for k in range(1, 5)}))
    if buckets is not None and longest > buckets[-1]:
        parser.error(f"the longest sequence ({longest}) is above the largest of --shape-buckets {buckets}")
    return {"seq_len_range": args.seq_len_range, "shapes": args.shapes, "shape_buckets": buckets}


def job_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    """The job ``args`` describe, checked the way the workers would check it (exit 2 if not)."""
    return job_and_start(args, parser)[0]


def job_and_start(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[JobSpec, ResumePoint]:
    """:func:`job_from_args`, and where the job starts (the notes and set-asides to act on)."""
    from graph_exec.examples import TRAINABLE_BY_DEFAULT

    micro, batch = workload(args, parser)
    if args.baseline and (args.run_ahead or args.backward or args.keep_preprocess_tape):
        parser.error(
            "--baseline runs without MPipe: --run-ahead (--overflow), --backward and --keep-preprocess-tape "
            "do not apply"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}")
    trainable = TRAINABLE_BY_DEFAULT[args.example] if args.trainable is None else args.trainable
    if args.zero and args.dp < 2:
        parser.error(
            f"--zero 1 shards the optimizer state over the data-parallel replicas, but --dp is {args.dp}: "
            "pass --dp 2 or more (with --ranks a multiple of it), or --zero 0"
        )
    if args.keep_preprocess_tape and not trainable:
        parser.error("--keep-preprocess-tape needs a trainable preprocess (pass --trainable)")
    spec = RunSpec(
        name="run",
        mode=args.mode,
        baseline=args.baseline,
        trainable=trainable,
        run_ahead=args.run_ahead or "full",
        backward=args.backward or "central",
        keep_preprocess_tape=args.keep_preprocess_tape,
        body=args.body,
        layers=args.layers,
        optimizer_sharding=bool(args.zero),
    )
    shapes = shape_options(args, parser)
    job = checked_job(args, parser, (spec,), micro=micro, batch=batch, steps=args.steps, warmup=0)
    if args.layers is not None and args.example not in LAYERS_EXAMPLES:
        parser.error(
            f"--layers needs an example with a per-stage split ({', '.join(LAYERS_EXAMPLES)}), not {args.example}"
        )
    if args.layers is not None and len(args.layers) != job.pp * job.vpp:
        parser.error(
            f"--layers {','.join(map(str, args.layers))} gives {len(args.layers)} stages, this job has "
            f"P x V = {job.pp} x {job.vpp} = {job.pp * job.vpp}: give one block count per stage"
        )
    pretrained = pretrained_options(args, parser)
    images = {**image_options(args, parser), **dataset_options(args, parser)}
    if images:
        pretrained["model_options"] = {**(pretrained["model_options"] or {}), **images}
    job = dataclasses.replace(job, **shapes, **pretrained, data=data_option(args, parser))
    point = first_step(args, parser, job)
    # at least one step (the caller stops before launching when none remain), or none: load, export
    steps, warmup = (0, 0) if args.steps == 0 else _split(max(args.steps - point.step, 1))
    job = dataclasses.replace(job, steps=steps, warmup=warmup)
    if args.checkpoint_dir is None:
        return job, point
    return dataclasses.replace(
        job, first_step=point.step, save_every=args.save_every or 0, checkpoint_dir=str(args.checkpoint_dir)
    ), point


def _split(remaining: int) -> tuple[int, int]:
    """``(steps, warmup)`` of a launch that trains ``remaining >= 1`` steps: the first is warm-up."""
    return (remaining - 1, 1) if remaining > 1 else (1, 0)


def resumed_job(job: JobSpec, say: Callable[[str], None]) -> JobSpec | str:
    """``job`` relaunched from the latest usable checkpoint of its directory (what ``--resume``
    does: a corrupt latest step is set aside for the previous complete one, and ``say`` is told),
    or why it cannot be: every step is in a complete checkpoint already, or none can be loaded."""
    folder = Path(job.checkpoint_dir or "")
    try:
        point = choose(folder, resume=True, resume_step=None, expected=None)
    except ResumeRefused as refused:
        return str(refused)
    for note in point.notes(corrupt_only=True):  # the debris of a save that died is expected here
        say(note)
    set_aside(folder, point, say)
    latest = point.step
    if latest >= job.end_step:
        return f"checkpoint step {latest} is complete: the training finished, the job failed after it"
    steps, warmup = _split(job.end_step - latest)
    return dataclasses.replace(job, first_step=latest, steps=steps, warmup=warmup)


def on_usable_ranks(original: JobSpec, resumed: JobSpec, min_ranks: int | None) -> tuple[JobSpec | str, str]:
    """The relaunch ``resumed`` on the ranks this host can run now (:func:`graph_exec.device.
    usable_ranks`): the job's own plan (``original``'s) when they are all there, else re-planned
    on fewer (:func:`graph_exec.replan.plan_on_fewer`) when ``min_ranks`` allows; or why there is
    no relaunch. Also a line saying what was decided (``""``: nothing changed)."""
    usable = device.usable_ranks(original.device)
    own = dataclasses.replace(
        resumed, ranks=original.ranks, dp=original.dp, vpp=original.vpp, micro=original.micro
    )
    if usable is None or usable >= original.ranks:
        back = (
            f"all {original.ranks} ranks usable again, back to {layout(own)}"
            if resumed.ranks != own.ranks
            else ""
        )
        return own, back
    if min_ranks is None:
        return (
            f"only {usable} of the job's {original.ranks} ranks are usable (pass --min-ranks N to go on with fewer)",
            "",
        )
    try:
        planned = plan_on_fewer(own, usable, min_ranks)
    except ReplanError as error:
        return str(error), ""
    return planned, (
        f"only {usable} of {original.ranks} ranks usable: re-planned on {planned.ranks} ranks, "
        f"{layout(own)} -> {layout(planned)}; the {own.pp * own.vpp} stages, the split and the global batch "
        f"{own.batch} are kept, the checkpoint loads by name"
    )


def describe(job: JobSpec) -> str:
    """One line saying what is being trained."""
    spec = job.runs[0]
    schedule = (
        "fair baseline (interleaved 1F1B, preprocess on rank 0, not transposed)"
        if spec.baseline
        else f"MPipe run_ahead={spec.run_ahead} backward={spec.backward}"
        + (" keep_preprocess_tape" if spec.keep_preprocess_tape else "")
    )
    return (
        f"{job.example} ({job.size}, {'trainable' if spec.trainable else 'frozen'} preprocess) on "
        f"{job.ranks} ranks ({job.mesh}{f', {job.nodes} nodes' if job.nodes > 1 else ''}), {spec.mode} mode "
        f"on {DevicePolicy.for_target(job.device, fast_paths_requested()).describe()}, "
        f"V={job.vpp} M={job.micro} per replica, batch {job.batch}, {schedule}"
        + (f", lengths {job.seq_len_range[0]}-{job.seq_len_range[1]}" if job.seq_len_range else "")
        + (f", shape buckets {job.shape_buckets}" if job.shapes == "buckets" else "")
        + (", shuffled data (graph_exec.data)" if job.data == "shuffled" else "")
    )


def progress_text(line: dict, total: int, mesh: str | None = None) -> str:
    """What the user sees for one progress line of the workers."""
    if "resuming" in line:
        return f"loading checkpoint step {line['resuming']}..."
    if "resumed" in line:
        return f"resumed from checkpoint step {line['resumed']} (loaded in {line['seconds'] * 1e3:.0f} ms)"
    loss = "-" if line["loss"] is None else f"{line['loss']:.4f}"
    where = f"  [{mesh}]" if mesh else ""
    text = f"step {line['step'] + 1:>3}/{total}{where}  loss {loss}  last stage's run() {line['seconds'] * 1e3:8.1f} ms"
    tokens = line.get("tokens")
    if tokens and tokens["padded"]:
        rate = tokens["real"] / line["seconds"] if line["seconds"] > 0 else float("inf")
        text += f"  {rate:,.0f} real tokens/s, padding {1 - tokens['real'] / tokens['padded']:.0%}"
    if line.get("tower_spread") is not None:
        text += f"  tower cost max/mean {line['tower_spread']:.2f}"
    compiled = line.get("compiled")
    if compiled:
        why = "" if compiled.get("first") else " for a new shape"
        text += f"  compiled {compiled['graphs']} graph(s){why} in {compiled['seconds']:.1f} s"
    saved = line.get("checkpoint")
    if saved:
        text += (
            f"  checkpoint written to {saved['path']} in {saved['seconds'] * 1e3:.0f} ms "
            f"({saved['bytes'] / 2**20:.2f} MiB, all ranks)"
        )
    return text


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    job, point = job_and_start(args, parser)
    for note in point.notes():
        print(f"graph-exec run: {note}", file=sys.stderr)
    if job.first_step >= args.steps and args.steps:
        print(f"nothing to do: the latest checkpoint is step {job.first_step}, --steps is {args.steps}")
        return 0
    if args.checkpoint_dir is not None and args.node_rank == 0:  # one launcher renames (the dir is shared)
        set_aside(args.checkpoint_dir, point, lambda text: print(f"graph-exec run: {text}", file=sys.stderr))
    total = job.end_step
    print(describe(job), flush=True)
    if job.first_step:
        print(f"resuming from {Path(job.checkpoint_dir or '') / f'step_{job.first_step}'}", flush=True)

    def progress(line: dict) -> None:
        print(progress_text(line, total, current[-1].mesh), flush=True)

    began = time.monotonic()
    current = [job]  # the job of the latest attempt

    def relaunch(attempt: int) -> JobSpec | str:
        resumed = resumed_job(current[-1], lambda text: print(f"graph-exec run: {text}", file=sys.stderr))
        if isinstance(resumed, JobSpec):
            resumed, said = on_usable_ranks(job, resumed, args.min_ranks)
            if said:
                print(f"graph-exec run: {said}", file=sys.stderr, flush=True)
        if isinstance(resumed, JobSpec):
            current.append(resumed)
            print(
                f"graph-exec run: restarting, attempt {attempt} (restart {attempt} of at most "
                f"{args.max_restarts}), from checkpoint step {resumed.first_step}",
                file=sys.stderr,
                flush=True,
            )
        return resumed

    try:
        with run_directory(args.log_dir) as run_dir:
            result = execute(
                job,
                run_dir,
                args.timeout,
                progress,
                "graph-exec run",
                nodes_of(args, parser),
                Restarts(args.max_restarts, relaunch) if args.max_restarts else None,
            )
            _report(args, current[-1], run_dir, time.monotonic() - began, result.attempts)
    except JobFailed as failed:
        return failed.code
    return 0


def _report(
    args: argparse.Namespace, job: JobSpec, run_dir: Path, total_s: float, attempts: Sequence[Attempt] = ()
) -> None:
    """The summary, the trace and the plot of a finished run (of its last attempt's steps)."""
    total, first = job.end_step, job.first_step
    if job.export_dir is not None:
        print(f"exported to {job.export_dir}")
    if job.total_steps == 0:
        print(f"done: loaded and exported, no training, on {job.mesh} in {total_s:.1f} s")
        return
    records = read_run(run_dir, "run", job.ranks)
    summary = summarize(records, job.warmup, job.pp * job.vpp - 1)
    restarts = len(attempts) - 1
    after = (
        f" (the last attempt's, after {restarts} restart{'s' if restarts != 1 else ''})"
        if restarts > 0
        else ""
    )
    print(
        f"done: {job.total_steps} steps{after} on {job.mesh} in {total_s:.1f} s, including start-up and "
        "compilation"
    )
    if restarts > 0:
        print(f"attempts: {len(attempts)}")
        for attempt in attempts:
            print(f"  {attempt.describe()}")
    over = " (mean over the replicas)" if job.dp > 1 else ""
    print(f"loss{over}: {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}")
    measured = {0: "all steps", job.total_steps - 1: f"step {total}"}.get(
        job.warmup, f"steps {first + job.warmup + 1}-{total}"
    )
    print(f"median step time: {summary.step_time * 1e3:.1f} ms ({measured}; first rank in to last rank out)")
    print(f"compilations: {summary.compilations} ({summary.compile_seconds:.1f} s, summed over ranks)")
    if job.warmup:
        print(f"receive-buffer allocations after warm-up: {summary.allocations_after_warmup}")
    lines = memory_lines(records)
    if lines:
        print("memory per rank (the last step's peaks):")
        for line in lines:
            print(f"  {line}")
    if args.trace:
        args.trace.write_text(json.dumps(chrome_trace(records, describe(job))), encoding="utf-8")
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        plot_timeline(records, -1, args.plot, f"{job.example} {job.runs[0].mode}")
        print(f"timeline of the last step drawn in {args.plot}")
    if args.log_dir:
        print(f"logs and per-rank records in {run_dir}")
