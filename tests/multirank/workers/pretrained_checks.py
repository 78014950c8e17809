"""Pretrained directories on real ranks: ``load_split`` per rank against mindone's ``from_pretrained``.

Usage: ``pretrained_checks.py DIR [CASE ...]`` where ``DIR`` holds ``llama``, ``qwen2`` (tied)
and ``qwen2vl`` directories written by ``graph_exec.examples.make_pretrained`` (at least P
decoder layers each), and an empty ``exports`` folder; the cases by name (default: those of
the 2-rank test, :data:`CASES_2`).

Each rank materialises only its share with ``load_split(dir, P, rank=r, pp=P)`` and trains one
step through ``ScheduleMPipeTranspose``; the reference is the whole model that mindone's
``from_pretrained`` loads from the same directory (its own ``construct`` under
``value_and_grad``, per micro-batch). Each rank compares what it holds: the losses on the last
stage's rank and every gradient it trains, within 1e-6 (the largest difference is printed).
The tied Qwen2 runs with ``tied_parameters``: both copies' gradients are the tied gradient.
After each case every rank calls ``export_pretrained``; rank 0 then checks that the export
reproduces the input directory bit for bit and that ``from_pretrained`` reads it. Failed
comparisons are printed and counted, not raised, so the ranks stay in step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.hub.directory import PretrainedDirectory
from graph_exec.models.pretrained import load_config
from graph_exec.msenv import prepare_mindspore
from tests.models import mindone_models as mm
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

GRID = (1, 4, 4)
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # llama | qwen2 | qwen2vl: the directory's name
    mode: str
    micro: int = 4


CASES = {
    case.name: case
    for case in (
        Case("llama_graph", "llama", "graph"),
        Case("llama_pynative", "llama", "pynative"),
        Case("qwen2_tied_graph", "qwen2", "graph"),
        Case("qwen2_tied_pynative", "qwen2", "pynative"),
        Case("qwen2vl_graph", "qwen2vl", "graph"),
        Case("qwen2vl_pynative", "qwen2vl", "pynative"),
    )
}
#: The 2-rank test's cases (the default).
CASES_2 = ("llama_graph", "qwen2_tied_pynative", "qwen2vl_graph", "qwen2vl_pynative")


def largest_difference(actual: dict, expected: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for key in sorted(actual):
        diff = float(np.abs(actual[key] - expected[key]).max())
        if diff >= worst:
            worst, where = diff, key
    return worst, where


def tensors(folder: Path) -> dict[str, np.ndarray]:
    shards = PretrainedDirectory(folder)
    return {name: shards.read(name) for name in shards.tensors}


def run_case(case: Case, root: Path, pp: int, rank: int, checker: Checker) -> None:
    began = time.perf_counter()
    folder = root / case.model
    options = {"image_grid": GRID} if case.model == "qwen2vl" else {}
    parts = gm.load_split(folder, pp, rank=rank, pp=pp, **options)
    ref = gm.model_class(load_config(folder)).from_pretrained(str(folder), attn_implementation="eager")
    frozen = {p.name for p in parts.preprocess.get_parameters() if not p.requires_grad}
    for param in ref.get_parameters():
        param.requires_grad = param.requires_grad and param.name not in frozen
    stages = [ge.PipelineStage(parts.stages[rank], rank, pp)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        case.micro,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=case.mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
        timeout_s=180,
        tied_parameters=[parts.tied_weights] if parts.tied_weights else None,
    )
    inputs, labels = mm.batch(case.model, ref, 2 * case.micro, step=1)
    ref_losses, ref_grads = mm.reference(case.model, ref, inputs, labels, case.micro, scale=1.0 / case.micro)
    if parts.tied_weights:  # the reference's one tied weight, under each copy's name
        ref_grads[parts.tied_weights[1]] = ref_grads[parts.tied_weights[0]]
    losses = sched.run(*inputs, labels=labels)
    if rank == pp - 1:
        got = np.array([float(x.asnumpy()) for x in losses])
        diff = float(np.abs(got - ref_losses).max())
        checker.check(f"{case.name}.losses", diff <= TOLERANCE, f"max |diff| {diff:.3g}")
        print(f"case {case.name} losses max |diff| {diff:.3g}", flush=True)
    grads = grads_numpy(sched)
    expected = {k: v for k, v in ref_grads.items() if k in grads}
    names_ok = set(grads) == {p.name for p in sched.trainable_params()} and set(expected) == set(grads)
    worst, where = largest_difference(grads, expected)
    checker.check(f"{case.name}.grads", names_ok and worst <= TOLERANCE, f"max |diff| {worst:.3g} at {where}")
    print(
        f"case {case.name} rank {rank}: {len(grads)} gradients, max |diff| {worst:.3g} ({where})", flush=True
    )
    out = gm.export_pretrained(parts, root / "exports" / case.name, max_shard_size=100_000)
    if rank == 0:
        source, exported = tensors(folder), tensors(out)
        same = sorted(source) == sorted(exported) and all(
            exported[k].dtype == v.dtype
            and exported[k].shape == v.shape
            and exported[k].tobytes() == v.tobytes()
            for k, v in source.items()
        )
        checker.check(f"{case.name}.export_round_trip", same, f"{len(source)} tensors vs {len(exported)}")
        again = gm.model_class(load_config(out)).from_pretrained(str(out), attn_implementation="eager")
        checker.check(f"{case.name}.export_loads", len(list(again.get_parameters())) > 0)
    print(f"case {case.name} took {time.perf_counter() - began:.1f} s", flush=True)


def main() -> int:
    prepare_mindspore("CPU")
    init()
    rank, pp = get_rank(), get_group_size()
    root = Path(sys.argv[1])
    cases = [CASES[name] for name in (sys.argv[2:] or CASES_2)]
    checker = Checker(rank)
    return run_suite(cases, lambda case: run_case(case, root, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
