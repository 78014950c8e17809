"""``recompute=True`` on real ranks, both modes, against the reference, in one msrun job.

The default (taped, no recompute) path is covered by ``pipeline_checks.py``. Here every case
runs with ``recompute=True``: each rank builds the whole model (same seed), keeps its chunks,
trains one step and compares its per-micro losses (last rank) and every gradient it trains with
a non-pipelined reference it computes itself (atol 1e-5, rtol 1e-4); a pynative case must also
equal the graph case it names. Failures are printed and counted, never raised, so the ranks
stay in step.

Usage: ``recompute_checks.py`` (P = the msrun world size).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.msenv import prepare_mindspore
from tests.models.common import loss_fn
from tests.models.pipeline import batch, build, reference
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, owned_view, run_suite


@dataclass(frozen=True)
class Case:
    name: str
    mode: str
    vpp: int = 1
    micro: int = 4
    preprocess: str = "trainable"
    backward: str = "central"
    overflow: str = "full"
    input: str = "replicated"
    tokens: bool = False
    baseline: bool = False  # ScheduleInterleaved1F1B instead of MPipe
    same_as: str | None = None


CASES = [
    Case("graph_v1_trainable_central", "graph"),
    Case("pynative_v1_trainable_central", "pynative", same_as="graph_v1_trainable_central"),
    Case("graph_v2_trainable_owner_min", "graph", vpp=2, backward="owner", overflow="min", micro=5),
    Case(
        "pynative_v2_trainable_owner_min",
        "pynative",
        vpp=2,
        backward="owner",
        overflow="min",
        micro=5,
        same_as="graph_v2_trainable_owner_min",
    ),
    Case("graph_v2_none_owned_tokens", "graph", vpp=2, preprocess="none", input="owned", tokens=True),
    Case("graph_baseline_v2", "graph", vpp=2, preprocess="none", baseline=True),
    Case(
        "pynative_baseline_v2",
        "pynative",
        vpp=2,
        preprocess="none",
        baseline=True,
        same_as="graph_baseline_v2",
    ),
]


def run_case(case: Case, pp: int, rank: int, checker: Checker, results: dict) -> None:
    num_stages = pp * case.vpp
    model = build(num_stages, case.preprocess, tokens=case.tokens)
    ref = build(num_stages, case.preprocess, tokens=case.tokens)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    options = {"mode": case.mode, "loss_fn": loss_fn, "timeout_s": 120, "recompute": True}
    if case.baseline:
        sched = ge.ScheduleInterleaved1F1B(stages, case.micro, **options)
    else:
        pre = model.preprocess
        sched = ge.ScheduleMPipeTranspose(
            stages,
            case.micro,
            pre,
            0 if pre is None else 1,
            overflow=case.overflow,
            backward=case.backward,
            input=case.input,
            **options,
        )
    size = 2 * case.micro
    x, labels = batch(size, tokens=case.tokens)
    ref_losses, ref_grads = reference(ref, x, labels, case.micro, 1.0)
    mine = {p.name for p in sched.trainable_params()}
    expected = {k: v for k, v in ref_grads.items() if k in mine}
    view = x if case.baseline else owned_view(case, pp, rank, x, size)
    losses = sched.run(view, labels=labels)
    if rank == pp - 1:
        checker.losses(f"{case.name}.losses", losses, ref_losses)
    grads = grads_numpy(sched)
    checker.close(f"{case.name}.grads", grads, expected)
    results[case.name] = grads
    if case.same_as is not None:
        checker.close(f"{case.name}.equals_{case.same_as}", grads, results[case.same_as])
    checker.check(f"{case.name}.nothing_kept", not sched._setup.executor.kept())


def main() -> int:
    prepare_mindspore("CPU")
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    results: dict = {}
    return run_suite(CASES, lambda case: run_case(case, pp, rank, checker, results), checker)


if __name__ == "__main__":
    sys.exit(main())
