"""Host memory and time of setting a pipeline rank up from a pretrained directory.

``python -m graph_exec.benchmarks.load_memory [--layers 11] [--ranks 2,4]`` writes a random
Llama of about 200 M parameters in float32 (hidden 1024, MLP 4096, 16 heads, vocabulary 8192,
11 layers: 202 M) with ``make_pretrained`` into a temporary directory, then measures, each
rank in a process of its own (one after the other, so they do not compete for memory), the
peak resident set size of set-up only (build + cut + load) on two paths:

- **whole**: today's path, every rank loads the whole model with mindone's ``from_pretrained``
  and cuts it with ``split_model``;
- **new**: :func:`graph_exec.models.load_split`, which materialises only the rank's share.

A third kind of process imports mindspore and mindone and builds nothing: its peak RSS is the
baseline. Prints per rank: own parameter bytes (its chunks and the replicated embedding), both
peaks, their ratio new / whole, the goal ``new ≤ 1.2 × own + baseline`` and both set-up times.
Peak RSS is the kernel's ``ru_maxrss`` of the process, read at the end of set-up. V = 1 (one
chunk per rank).

``--resume 2:4,4:2``: instead, each rank's memory when it loads a checkpoint written under
another plan, against its own share (:mod:`graph_exec.benchmarks.resume_memory`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "LOAD_MEMORY "


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(kind: str, folder: str, rank: int, pp: int) -> None:
    """One measurement, in this (fresh) process; prints one ``LOAD_MEMORY`` JSON line."""
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    import graph_exec.models as gm

    gm.mindone()
    result: dict = {"kind": kind, "rank": rank, "pp": pp}
    began = time.perf_counter()
    if kind == "whole":
        from graph_exec.models.pretrained import load_config

        model = gm.model_class(load_config(folder)).from_pretrained(folder, attn_implementation="eager")
        split = gm.split_model(model, pp)
    elif kind == "new":
        split = gm.load_split(folder, pp, rank=rank, pp=pp)
    if kind != "baseline":
        result["seconds"] = time.perf_counter() - began
        cells = [split.stages[rank], *([split.preprocess] if split.preprocess is not None else [])]
        own = {id(p): p for cell in cells for p in cell.get_parameters()}
        result["own_bytes"] = sum(int(p.size) * p.itemsize for p in own.values())
    result["peak_rss"] = peak_rss_bytes()
    print(MARK + json.dumps(result), flush=True)


def measure(kind: str, folder: Path, rank: int = 0, pp: int = 1) -> dict:
    argv = [sys.executable, "-m", "graph_exec.benchmarks.load_memory", "--child", kind, str(folder)]
    argv += ["--rank", str(rank), "--pp", str(pp)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} rank {rank}/{pp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK) :])


def gib(value: float) -> str:
    return f"{value / 2**30:6.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graph_exec.benchmarks.load_memory")
    parser.add_argument(
        "--layers", type=int, default=11, help="decoder layers (default 11: 202 M parameters)"
    )
    parser.add_argument("--ranks", default="2,4", help="pipeline sizes, comma-separated (default 2,4)")
    parser.add_argument(
        "--resume",
        metavar="SAVED:RESUMED,...",
        help="instead: each rank's memory when loading a checkpoint written at SAVED ranks on RESUMED "
        "ranks (graph_exec.benchmarks.resume_memory), e.g. 2:4,4:2",
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], args.rank, args.pp)
        return 0
    if args.resume:
        return _resume(args.resume, args.layers)
    sizes = [int(p) for p in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="load_memory_") as tmp:
        folder = Path(tmp) / "llama"
        began = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", _WRITE.format(layers=args.layers, folder=str(folder))],
            check=True,
            timeout=1800,
        )
        total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(
            f"Llama, {args.layers} layers, float32: {total / 4 / 1e6:.0f} M parameters, {gib(total)} in "
            f"{len(list(folder.glob('*.safetensors')))} shards (written in {time.perf_counter() - began:.0f} s)"
        )
        base = measure("baseline", folder)["peak_rss"]
        print(f"baseline (imported mindspore and mindone, built nothing): peak RSS {gib(base)}")
        print(
            f"{'P':>2} {'rank':>4} {'own params':>11} {'whole peak':>11} {'new peak':>11} {'new/whole':>9} "
            f"{'goal ≤':>11} {'met':>4} {'whole s':>8} {'new s':>7}"
        )
        for pp in sizes:
            for rank in range(pp):
                whole, new = measure("whole", folder, rank, pp), measure("new", folder, rank, pp)
                goal = 1.2 * new["own_bytes"] + base
                print(
                    f"{pp:>2} {rank:>4} {gib(new['own_bytes'])} {gib(whole['peak_rss'])} {gib(new['peak_rss'])} "
                    f"{new['peak_rss'] / whole['peak_rss']:9.2f} {gib(goal)} {'yes' if new['peak_rss'] <= goal else 'NO':>4} "
                    f"{whole['seconds']:8.1f} {new['seconds']:7.1f}",
                    flush=True,
                )
    return 0


def _resume(pairs: str, layers: int) -> int:
    from graph_exec.benchmarks import resume_memory

    try:
        parsed = [(int(a), int(b)) for a, b in (pair.split(":") for pair in pairs.split(","))]
    except ValueError:
        raise SystemExit(  # noqa: B904 (the message says it all)
            f"--resume takes SAVED:RESUMED pipeline sizes, comma-separated (e.g. 2:4,4:2), got {pairs!r}"
        )
    print(f"Llama, {layers} layers, float32, Adam; a checkpoint at SAVED ranks loaded by name at P ranks")
    with tempfile.TemporaryDirectory(prefix="resume_memory_") as tmp:
        resume_memory.run(parsed, layers, Path(tmp))
    return 0


_WRITE = """
from graph_exec.benchmarks.llama_202m import config
from graph_exec.examples.make_pretrained import make_pretrained
make_pretrained("llama", {folder!r}, config=config({layers}), max_shard_size=200 * 2**20, dtype="float32")
"""


if __name__ == "__main__":
    sys.exit(main())
