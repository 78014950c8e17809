"""Batches of real Qwen2-VL samples (``graph_exec.models.vlm_batch``) on real ranks.

Every rank builds the whole tiny mindone Qwen2-VL twice (same seed): one copy is cut with
``split_model`` (no ``image_grid``: any images per sample) and trained pipelined on a batch of
samples with three different grids, a sample with two images, a text-only sample and four text
lengths (padded); the other runs its own ``construct`` on each *unpadded* sample
(``tests.models.mindone_models.vlm_reference``). Each rank compares what it holds: the
per-micro-batch losses on the last stage's rank, every gradient it trains (atol 1e-5,
rtol 1e-4). A failed comparison is printed and counted, not raised, so the ranks stay in step.

Cases: graph and pynative, frozen and trainable tower, central and owner backward, V = 1 and 2,
and ``shapes="dynamic"`` over three batches of different mixes (shapes change between steps);
then ragged micro-batches (``vlm_micro_batches``: each micro-batch padded to its own patch count
and length, so shapes differ between micro-batches within a step) in graph mode with
``shapes="dynamic"`` and ``tower_order="balanced"`` placed by ``vlm_tower_costs``, over two
steps of different mixes (a micro-batch's shapes change under its label between steps).

Usage: ``vlm_batch_checks.py`` (the cases above) or ``vlm_batch_checks.py packed``: packed Llama
text rows (``pack`` + ``text_packed_micro_batches``, ``split_model(packed=True)``, several
samples per row, each attending only to itself) in graph and pynative with
``loss_reduction="token"``, against the whole Llama on each sample alone
(``mm.text_reference``): per-micro-batch per-token mean losses and the gradients of the global
per-token mean. Llama rather than Qwen2-VL: the segment mask and restarting positions cross
the real transport the same way, at a few seconds a case instead of a Qwen2-VL graph compile's
~20 s (the Qwen2-VL packed rows are checked on one process, tests/runtime/test_packing.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import mindspore as ms
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
import graph_exec.models as gm
from graph_exec.msenv import prepare_mindspore
from tests.models import mindone_models as mm
from tests.models.common import announce_policy
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

#: Further mixes for the dynamic case: other grids, counts and lengths, so other shapes.
MIXES = (
    mm.VLM_MIX,
    ((((8, 8), (8, 8), (16, 8)), 4), ((), 3), (((24, 24),), 2), (((8, 16),), 12)),
    (((), 6), ((), 2), (((16, 16), (8, 8)), 8), (((8, 8),), 5)),
)


@dataclass(frozen=True)
class Case:
    name: str
    mode: str = "graph"
    trainable: bool = False
    backward: str = "central"
    vpp: int = 1
    shapes: str = "static"
    steps: int = 1
    ragged: bool = False  #: run(micro_batches=vlm_micro_batches(...)), placed by their tower costs


CASES = [
    Case("vlmb_graph_frozen"),
    Case("vlmb_graph_trainable_owner", trainable=True, backward="owner"),
    Case("vlmb_pynative_trainable_v2", mode="pynative", trainable=True, vpp=2),
    Case("vlmb_pynative_frozen_v2", mode="pynative", vpp=2),
    Case("vlmb_graph_dynamic_trainable", trainable=True, shapes="dynamic", steps=3),
    Case("vlmb_graph_dynamic_ragged", trainable=True, shapes="dynamic", steps=2, ragged=True),
]
MICRO = 2


@dataclass(frozen=True)
class PackedCase:
    name: str
    mode: str


PACKED_CASES = [PackedCase("packed_llama_graph", "graph"), PackedCase("packed_llama_pynative", "pynative")]
#: Eight text samples in rows of 16 tokens, two rows per micro-batch.
PACKED_LENGTHS, PACKED_ROW = (11, 5, 9, 3, 7, 2, 14, 6), 16


def run_case(case: Case, pp: int, rank: int, checker: Checker) -> None:
    num_stages = pp * case.vpp
    began = time.perf_counter()
    model, ref = mm.whole("qwen2vl", num_stages), mm.whole("qwen2vl", num_stages)
    parts = gm.split_model(model, num_stages, trainable_preprocess=case.trainable)
    frozen = {p.name for p in parts.preprocess.get_parameters() if not p.requires_grad}
    for param in ref.get_parameters():
        param.requires_grad = param.requires_grad and param.name not in frozen
    stages = [ge.PipelineStage(parts.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        MICRO,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=case.mode,
        loss_fn=gm.causal_lm_loss,
        scale_grads=True,
        backward=case.backward,
        shapes=case.shapes,
        tower_order="balanced" if case.ragged else "arrival",
        timeout_s=180,
    )
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if rank == 0 or case.backward == "owner":
        mine |= {p.name for p in parts.preprocess.trainable_params()}
    for step in range(case.steps):
        samples = mm.vlm_samples(MIXES[step], seed=step)  # the same samples on every rank
        ref_losses, ref_grads = mm.vlm_reference(ref, samples, MICRO, scale=1.0 / MICRO)
        sched.zero_grad()
        losses = run_step(sched, parts, samples, case.ragged)
        holds_last = rank == pp - 1
        checker.check(f"{case.name}.step{step}.losses_where_expected", (losses is not None) == holds_last)
        if holds_last:
            checker.losses(f"{case.name}.step{step}.losses", losses, ref_losses)
        expected = {k: v for k, v in ref_grads.items() if k in mine}
        checker.close(f"{case.name}.step{step}.grads", grads_numpy(sched), expected)
    print(f"case {case.name} took {time.perf_counter() - began:.1f} s", flush=True)


def run_step(sched: ge.ScheduleMPipeTranspose, parts: gm.SplitModel, samples: list, ragged: bool):
    """One step on ``samples``: one batch cut by the schedule, or ragged micro-batches (each
    padded to its own sizes) placed by their real patches."""
    if not ragged:
        batch = gm.vlm_batch(parts, samples)
        return sched.run(*(ms.Tensor(a) for a in batch.inputs), labels=ms.Tensor(batch.labels))
    batches = gm.vlm_micro_batches(parts, samples, MICRO)
    return sched.run(micro_batches=batches, tower_costs=gm.vlm_tower_costs(batches))


def run_packed_case(case: PackedCase, pp: int, rank: int, checker: Checker) -> None:
    """One step on packed Llama rows; each rank compares the gradients it holds, the last
    stage's rank the losses."""
    from graph_exec.data import pack

    began = time.perf_counter()
    model, ref = mm.whole("llama", pp), mm.whole("llama", pp)
    parts = gm.split_model(model, pp, packed=True)
    stages = [ge.PipelineStage(parts.stages[rank], rank, pp)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        MICRO,
        parts.preprocess,
        parts.num_transpose_layers,
        mode=case.mode,
        loss_fn=gm.causal_lm_token_loss,
        loss_reduction="token",
        timeout_s=180,
    )
    samples = mm.text_samples(PACKED_LENGTHS)  # the same samples, so the same packing, on every rank
    packing = pack(gm.text_sample_costs(samples), PACKED_ROW, MICRO)
    checker.check(f"{case.name}.packs", max(len(row) for mb in packing.micro_batches for row in mb) >= 2)
    batches = gm.text_packed_micro_batches(samples, packing, PACKED_ROW)
    losses = sched.run(micro_batches=[(tuple(ms.Tensor(a) for a in x), ms.Tensor(y)) for x, y in batches])
    sums, ref_grads = mm.text_reference(ref, samples)
    counts = [int((s["labels"] >= 0).sum()) for s in samples]
    holds_last = rank == pp - 1
    checker.check(f"{case.name}.step0.losses_where_expected", (losses is not None) == holds_last)
    if holds_last:
        ref_losses = [
            sum(sums[i] for row in mb for i in row) / sum(counts[i] for row in mb for i in row)
            for mb in packing.micro_batches
        ]
        checker.losses(f"{case.name}.step0.losses", losses, ref_losses)
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if rank == 0:
        mine |= {p.name for p in parts.preprocess.trainable_params()}
    checker.check(f"{case.name}.holds_grads", bool(mine))
    checker.close(
        f"{case.name}.step0.grads", grads_numpy(sched), {k: v for k, v in ref_grads.items() if k in mine}
    )
    print(f"case {case.name} took {time.perf_counter() - began:.1f} s", flush=True)


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    if sys.argv[1:] == ["packed"]:
        return run_suite(PACKED_CASES, lambda case: run_packed_case(case, pp, rank, checker), checker)
    return run_suite(CASES, lambda case: run_case(case, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
