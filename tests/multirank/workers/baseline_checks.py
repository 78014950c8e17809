"""The fair baseline (``ScheduleInterleaved1F1B`` with a preprocess) on real ranks, against the reference.

One msrun launch per world size runs every case of its suite. Every rank builds the whole
model (same seed), keeps its own chunks, runs the baseline and compares what it holds —
per-micro losses on the last rank, every gradient it trains (the preprocess ones on rank 0
only) — with a single-process, non-pipelined reference (atol 1e-5, rtol 1e-4). A failed
comparison is printed and counted, not raised, so the ranks stay in step. Besides the numbers,
each case checks the plan's promise: no broadcast, no transfer of preprocess outputs, the
preprocess run on rank 0 only, and (frozen) no preprocess backward at all.

Usage: ``baseline_checks.py SUITE`` with SUITE one of :data:`SUITES`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.msenv import prepare_mindspore
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference, sgd_step
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite


@dataclass(frozen=True)
class Case:
    name: str
    preprocess: str  # trainable | frozen
    vpp: int = 1
    micro: int = 4
    mode: str = "graph"
    others_pass_none: bool = False  # ranks other than 0 pass preprocess_module=None
    optimizer: bool = False  # SGD step, then a second step compared with the reference doing the same
    twice: bool = False  # a second run() without zero_grad accumulates twice the gradient


SUITES: dict[str, list[Case]] = {
    "p2": [
        Case("v1_trainable", "trainable", twice=True, optimizer=True),
        Case("v2_frozen_m5", "frozen", vpp=2, micro=5),
        Case("v2_trainable_others_none", "trainable", vpp=2, others_pass_none=True, optimizer=True),
        Case("v1_frozen_pynative", "frozen", mode="pynative", others_pass_none=True),
        Case("v2_trainable_pynative_m3", "trainable", vpp=2, micro=3, mode="pynative", twice=True),
    ],
    "p4": [
        Case("v2_trainable_m8", "trainable", vpp=2, micro=8, optimizer=True),
        Case("v1_frozen_m6", "frozen", micro=6, others_pass_none=True),
        Case("v2_frozen_pynative_m4", "frozen", vpp=2, mode="pynative"),
        Case("v1_trainable_pynative_m8", "trainable", micro=8, mode="pynative", others_pass_none=True),
    ],
}


def check_steps(case: Case, sched, rank: int, checker: Checker) -> None:
    """What ran: preprocess steps on rank 0 only, no broadcast or preprocess transfer anywhere."""
    tokens = [event.step for event in sched.timeline]
    mpipe = [t for t in tokens if t.startswith(("BCAST", "OUT", "IN", "GRAD"))]
    checker.check(f"{case.name}.no_broadcast_or_transfer", not mpipe, f"{mpipe}")
    tfwd = [t for t in tokens if t.startswith("TFWD")]
    tbwd = [t for t in tokens if t.startswith("TBWD")]
    micros = range(case.micro) if rank == 0 else range(0)
    expected_tfwd = [f"TFWD{m}" for m in micros]
    expected_tbwd = [f"TBWD{m}" for m in micros] if case.preprocess == "trainable" else []
    checker.check(
        f"{case.name}.preprocess_on_rank_0_only",
        tfwd == expected_tfwd and tbwd == expected_tbwd,
        f"TFWD {tfwd}, TBWD {tbwd}",
    )


def run_case(case: Case, pp: int, rank: int, checker: Checker) -> None:
    num_stages = pp * case.vpp
    model = build(num_stages, case.preprocess)
    ref = build(num_stages, case.preprocess)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    pre = None if case.others_pass_none and rank != 0 else model.preprocess
    sched = ge.ScheduleInterleaved1F1B(
        stages, case.micro, pre, 1, mode=case.mode, loss_fn=loss_fn, timeout_s=120
    )
    x, labels = batch(2 * case.micro)
    ref_losses, ref_grads = reference(ref, x, labels, case.micro)
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if rank == 0:
        mine |= {p.name for p in model.preprocess.trainable_params()}
    expected = {k: v for k, v in ref_grads.items() if k in mine}
    holds_last = rank == pp - 1

    losses = sched.run(x, labels=labels)
    checker.check(f"{case.name}.losses_where_expected", (losses is not None) == holds_last)
    if holds_last:
        checker.losses(f"{case.name}.losses", losses, ref_losses)
    checker.close(f"{case.name}.grads", grads_numpy(sched), expected)
    check_steps(case, sched, rank, checker)
    if case.twice:
        sched.run(x, labels=labels)
        checker.close(f"{case.name}.accumulates_twice", grads_numpy(sched), expected, factor=2.0)
    if case.optimizer:
        lr = 0.5
        params = sched.trainable_params()
        sched.zero_grad()
        sched.run(x, labels=labels)
        nn.SGD(params, learning_rate=lr)(tuple(sched.grads()[p.name] for p in params))
        sgd_step(ref.params(), ref_grads, lr)
        sched.zero_grad()
        losses = sched.run(x, labels=labels)
        ref_losses, ref_grads = reference(ref, x, labels, case.micro)
        if holds_last:
            checker.losses(f"{case.name}.after_step_losses", losses, ref_losses)
        checker.close(
            f"{case.name}.after_step_grads", grads_numpy(sched), {k: ref_grads[k] for k in expected}
        )


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    return run_suite(SUITES[sys.argv[1]], lambda case: run_case(case, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
