"""Host memory of each rank's load when resuming a checkpoint on another plan, against its share.

``python -m graph_exec.benchmarks.load_memory --resume 2:4,4:2 [--layers 11]`` (or this module
directly) takes the Llama of :mod:`graph_exec.benchmarks.load_memory` (202 M parameters,
float32), initialised from its config, and for each ``saved:resumed`` pair of pipeline sizes
(V = 1, D = 1):

1. writes a checkpoint at ``saved`` ranks, each rank in a process of its own: its chunk and the
   replicated embedding, with Adam's two moments, in graph_exec's rank-file format
   (:func:`graph_exec.checkpoint.state.write`), and the index of names -> files
   (:func:`graph_exec.checkpoint.index.build`) with each file's checksum;
2. for each rank of ``resumed``, in a fresh process: builds its share (its chunk and the
   embedding, and Adam over them), then loads it by name as ``load_checkpoint`` does (the index
   says which file holds each of its tensors; each file checked against its checksum and read
   by :func:`graph_exec.checkpoint.api._read_checked`; values copied in place), measuring the
   growth of resident memory during the load: the peak (``VmHWM``, reset through
   ``/proc/self/clear_refs`` right before the load) minus the resident size before it.

Prints per rank: its share (parameter + optimizer state bytes under the new plan), the bytes it
read from the checkpoint files, the growth and growth / share (target ≤ 1.2), for graph_exec's
reader and, for comparison, for ``mindspore.load_checkpoint(choice_func=...)``, which parses each
whole file it opens. Linux only (``/proc``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

MARK = "RESUME_MEMORY "
READERS = ("graph_exec", "mindspore")


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _share(rank: int, pp: int, layers: int) -> tuple[dict, dict]:
    """This rank's parameters and Adam state under ``pp`` ranks, by name (fresh values)."""
    from mindspore import nn

    import graph_exec.models as gm
    from graph_exec.benchmarks.llama_202m import config
    from graph_exec.checkpoint import state
    from graph_exec.device import assign_in_place

    gm.mindone()
    split = gm.load_split(config(layers), pp, rank=rank, pp=pp)
    cells = [split.stages[rank], *([split.preprocess] if split.preprocess is not None else [])]
    model: dict = {}
    for cell in cells:
        model.update({p.name: p for p in cell.get_parameters()})
    optimizer = nn.Adam([p for p in model.values() if p.requires_grad], learning_rate=1e-3)
    extra = state.optimizer_state(optimizer, model)
    for value in {**model, **extra}.values():
        # MindSpore 2.10 on CPU gives a parameter new storage at its first in-place write (measured:
        # +256 MiB for a 288 MiB share, nothing at the second): a run's first step pays it load or
        # not, so it is paid here, before the load is measured
        assign_in_place(value, value.copy())
    return model, extra


def _save(folder: Path, rank: int, pp: int, layers: int) -> None:
    """Write ``rank``'s file of a ``pp``-rank checkpoint; print its listing."""
    from graph_exec.checkpoint import index, state

    model, extra = _share(rank, pp, layers)
    state.write({**model, **extra}, str(folder / f"rank_{rank}.ckpt"))
    listing = {**index.listing(model, "model"), **index.listing(extra, "optimizer")}
    print(MARK + json.dumps({"file": f"rank_{rank}.ckpt", "listing": listing}), flush=True)


def _resume(folder: Path, rank: int, pp: int, layers: int, reader: str) -> None:
    """Load ``rank``'s share under ``pp`` ranks by name; print the memory it took."""
    import gc

    import mindspore as ms

    from graph_exec.checkpoint import api, index, state

    model, extra = _share(rank, pp, layers)
    manifest = json.loads((folder / "manifest.json").read_text())
    wanted = {**index.want(model, "model"), **index.want(extra, "optimizer")}
    plan, problems = index.resolve(manifest["index"], wanted, f"rank_{rank}.ckpt")
    if problems:
        raise RuntimeError("; ".join(problems))
    share = sum(int(v.size) * v.itemsize for v in {**model, **extra}.values())
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    began = time.perf_counter()
    api._READ[0] = 0
    stored: dict = {}
    for file, names in sorted(plan.items()):
        if reader == "graph_exec":
            stored.update(api._read_checked(folder, file, manifest, set(names), rank, folder))
        else:
            stored.update(ms.load_checkpoint(str(folder / file), choice_func=set(names).__contains__))
            api._READ[0] += (folder / file).stat().st_size
    state.assign({**model, **extra}, stored)
    result = {
        "rank": rank,
        "share": share,
        "read": api._READ[0],
        "growth": _status("VmHWM") - before,
        "seconds": time.perf_counter() - began,
        "files": len(plan),
    }
    print(MARK + json.dumps(result), flush=True)


def _child(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "graph_exec.benchmarks.resume_memory", *argv],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{argv} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK) :])


def write_checkpoint(folder: Path, pp: int, layers: int) -> None:
    """A ``pp``-rank checkpoint in ``folder``: rank files, then ``manifest.json`` (index, checksums)."""
    from graph_exec.checkpoint import index, layout

    folder.mkdir(parents=True)
    outcomes = [_child(["--save", str(folder), str(r), str(pp), str(layers)]) for r in range(pp)]
    ranks = [
        {"rank": r, "file": o["file"], "sha256": layout.sha256_of(folder / o["file"])}
        for r, o in enumerate(outcomes)
    ]
    manifest = {"step": 0, "index": index.build(outcomes), "ranks": ranks}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def gib(value: float) -> str:
    return f"{value / 2**30:6.3f} GiB"


def run(pairs: list[tuple[int, int]], layers: int, root: Path) -> None:
    """Print the table for each ``(saved, resumed)`` pair."""
    print(
        f"{'saved':>5} {'P':>2} {'rank':>4} {'reader':>10} {'share':>10} {'read':>10} {'growth':>10} "
        f"{'growth/share':>12} {'≤ 1.2':>5} {'s':>5}"
    )
    for saved, resumed in pairs:
        folder = root / f"saved_{saved}"
        if not folder.exists():
            write_checkpoint(folder, saved, layers)
        for rank in range(resumed):
            for reader in READERS:
                found = _child(["--load", str(folder), str(rank), str(resumed), str(layers), reader])
                ratio = found["growth"] / found["share"]
                print(
                    f"{saved:>5} {resumed:>2} {rank:>4} {reader:>10} {gib(found['share'])} {gib(found['read'])} "
                    f"{gib(found['growth'])} {ratio:12.2f} {'yes' if ratio <= 1.2 else 'NO':>5} "
                    f"{found['seconds']:5.1f}",
                    flush=True,
                )


def main(argv: list[str]) -> int:
    """The children's entry (``--save``/``--load``); the table is :func:`run`'s."""
    if argv[0] == "--save":
        _save(Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]))
    elif argv[0] == "--load":
        _resume(Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]), argv[5])
    return 0


if __name__ == "__main__":
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    sys.exit(main(sys.argv[1:]))
