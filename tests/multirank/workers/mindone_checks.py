"""MindSpore ONE models split by ``graph_exec.models`` on real ranks, against the whole model.

Every rank builds the whole tiny mindone model twice (same seed): one copy is cut with
``split_model`` and trained pipelined, the other is the single-process reference (the whole
model's own ``construct`` under ``value_and_grad``, per micro-batch). Each rank compares what
it holds: the per-micro-batch losses on the last stage's rank, every gradient it trains
(atol 1e-5, rtol 1e-4). A failed comparison is printed and counted, not raised, so the ranks
stay in step.

Usage: ``mindone_checks.py`` (one suite: both modes, frozen and trainable vision tower,
central and owner backward, run_ahead full and min, the fair baseline on a rebalanced split,
Llama's trainable embedding).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.msenv import prepare_mindspore
from tests.models import mindone_models as mm
from tests.models.common import announce_policy
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

GRID = (1, 4, 4)


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # llama | qwen2vl
    mode: str = "graph"
    trainable: bool = False
    backward: str = "central"
    run_ahead: str = "full"
    vpp: int = 1
    micro: int = 4
    layers: tuple[int, ...] | None = None
    baseline: bool = False  # ScheduleInterleaved1F1B (the preprocess on rank 0, not transposed)


CASES = [
    Case("vlm_graph_frozen", "qwen2vl"),
    Case("vlm_graph_trainable_owner", "qwen2vl", trainable=True, backward="owner"),
    Case("vlm_pynative_trainable_central_v2", "qwen2vl", mode="pynative", trainable=True, vpp=2),
    Case("vlm_pynative_frozen_min_v2_m3", "qwen2vl", mode="pynative", run_ahead="min", vpp=2, micro=3),
    Case(
        "vlm_pynative_rebalanced_baseline",
        "qwen2vl",
        mode="pynative",
        vpp=2,
        layers=(0, 2, 1, 1),
        baseline=True,
    ),
    Case(
        "llama_pynative_embedding_owner_v2", "llama", mode="pynative", trainable=True, backward="owner", vpp=2
    ),
]


def run_case(case: Case, pp: int, rank: int, checker: Checker) -> None:
    num_stages = pp * case.vpp
    began = time.perf_counter()
    layers = num_stages if case.layers is None else sum(case.layers)  # one per stage: short compiles
    model, ref = mm.whole(case.model, layers), mm.whole(case.model, layers)
    options = {"image_grid": GRID} if case.model == "qwen2vl" else {}
    parts = gm.split_model(
        model, num_stages, layers=case.layers, trainable_preprocess=case.trainable, **options
    )
    frozen = {p.name for p in parts.preprocess.get_parameters() if not p.requires_grad}
    for param in ref.get_parameters():
        param.requires_grad = param.requires_grad and param.name not in frozen
    stages = [ge.PipelineStage(parts.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    common = {"mode": case.mode, "loss_fn": gm.causal_lm_loss, "scale_grads": True, "timeout_s": 180}
    if case.baseline:
        sched = ge.ScheduleInterleaved1F1B(
            stages, case.micro, parts.preprocess, parts.num_transpose_layers, **common
        )
    else:
        sched = ge.ScheduleMPipeTranspose(
            stages,
            case.micro,
            parts.preprocess,
            parts.num_transpose_layers,
            backward=case.backward,
            run_ahead=case.run_ahead,
            **common,
        )
    inputs, labels = mm.batch(case.model, ref, 2 * case.micro, step=1)  # the same batch on every rank
    ref_losses, ref_grads = mm.reference(case.model, ref, inputs, labels, case.micro, scale=1.0 / case.micro)
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if rank == 0 or (case.backward == "owner" and not case.baseline):
        mine |= {p.name for p in parts.preprocess.trainable_params()}
    losses = sched.run(*inputs, labels=labels)
    holds_last = rank == pp - 1
    checker.check(f"{case.name}.losses_where_expected", (losses is not None) == holds_last)
    if holds_last:
        checker.losses(f"{case.name}.losses", losses, ref_losses)
    checker.close(f"{case.name}.grads", grads_numpy(sched), {k: v for k, v in ref_grads.items() if k in mine})
    if case.layers is not None:
        checker.check(f"{case.name}.layers", parts.layers == case.layers, f"{parts.layers}")
    print(f"case {case.name} took {time.perf_counter() - began:.1f} s", flush=True)


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    return run_suite(CASES, lambda case: run_case(case, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
