"""``tower_order="balanced"`` on two real ranks, against the non-pipelined reference.

Every rank builds the whole model (same seed), keeps its chunks and runs the schedule with the
same per-micro-batch tower costs; the last rank's losses (in the user's order) and every rank's
gradients are compared with a single-process reference (atol 1e-5, rtol 1e-4: the placement
changes the summation order of the micro-batches only). Each rank prints the placement it
decided (``ORDER ...``) so the test can check that both reached the same one without a message,
and that it is not the identity where the costs call for a move.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.msenv import prepare_mindspore
from graph_exec.schedule import placement
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite


@dataclass(frozen=True)
class Case:
    name: str
    preprocess: str
    costs: tuple[float, ...]
    vpp: int = 1
    mode: str = "graph"
    baseline: bool = False
    run_ahead: str = "full"


CASES = [
    Case("mpipe_v1_trainable_graph", "trainable", (4, 1, 4, 1)),
    Case("mpipe_v2_frozen_pynative", "frozen", (1, 1, 6, 2, 5, 1), vpp=2, mode="pynative"),
    Case("mpipe_v1_frozen_min_graph", "frozen", (1, 1, 3, 3, 1, 2), run_ahead="min"),
    Case("baseline_v1_trainable_graph", "trainable", (3, 1, 1, 1), baseline=True),
]


def run_case(case: Case, pp: int, rank: int, checker: Checker) -> None:
    micro = len(case.costs)
    num_stages = pp * case.vpp
    model, ref = build(num_stages, case.preprocess), build(num_stages, case.preprocess)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    if case.baseline:
        pre = model.preprocess if rank == 0 else None  # the other ranks need not pass it
        sched = ge.ScheduleInterleaved1F1B(
            stages, micro, pre, 1, mode=case.mode, loss_fn=loss_fn, timeout_s=120, tower_order="balanced"
        )
    else:
        sched = ge.ScheduleMPipeTranspose(
            stages,
            micro,
            model.preprocess,
            1,
            mode=case.mode,
            loss_fn=loss_fn,
            timeout_s=120,
            run_ahead=case.run_ahead,
            tower_order="balanced",
        )
    x, labels = batch(2 * micro)
    ref_losses, ref_grads = reference(ref, x, labels, micro)
    trained = {p.name for p in sched.trainable_params()}
    expected = {k: v for k, v in ref_grads.items() if k in trained}
    losses = sched.run(x, labels=labels, tower_costs=list(case.costs))
    order = placement.tower_order(placement.tower_positions(sched.plan.config), case.costs, "balanced")
    print(f"ORDER {case.name} {','.join(map(str, order))}", flush=True)
    if rank == pp - 1:
        checker.losses(f"{case.name}.losses", losses, ref_losses)
    checker.close(f"{case.name}.grads", grads_numpy(sched), expected)


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    return run_suite(CASES, lambda case: run_case(case, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
