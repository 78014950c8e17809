"""Run many pipeline configurations in one msrun job and check each against the reference.

Communication init costs seconds, so one launch covers a whole suite. Every rank builds the
whole model (same seed, identical weights), keeps its own chunks, runs the pipeline, and
compares what it holds — per-micro losses on the last rank, every gradient it trains — with a
single-process, non-pipelined reference it computes itself (atol 1e-5, rtol 1e-4). A failed
comparison is printed and counted, not raised, so every rank stays in step with the others.

Usage: ``pipeline_checks.py SUITE`` with SUITE one of :data:`SUITES`.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass

import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.msenv import prepare_mindspore
from graph_exec.schedule import PlanConfig
from tests.pipeline_models import ATOL, RTOL, batch, build, loss_fn, reference, sgd_step


@dataclass(frozen=True)
class Case:
    name: str
    vpp: int = 1
    micro: int = 4
    preprocess: str = "trainable"  # trainable | frozen | none
    overflow: str = "full"
    backward: str = "central"
    input: str = "replicated"
    mode: str = "graph"
    tokens: bool = False
    scale_grads: bool = False
    twice: bool = False  # second run() without zero_grad accumulates twice the gradient
    optimizer: bool = False  # SGD step, then a second step compared with the reference doing the same
    same_as: str | None = None  # gradients must equal that earlier case's (graph vs pynative)


SUITES: dict[str, list[Case]] = {
    "p2": [
        Case("v1_trainable_central_full", twice=True, optimizer=True),
        Case("v1_trainable_central_min_owned", overflow="min", input="owned"),
        Case("v1_trainable_owner_full", backward="owner", twice=True, optimizer=True),
        Case("v1_frozen_full_m3", preprocess="frozen", micro=3),
        Case("v1_none_replicated", preprocess="none", scale_grads=True),
        Case("v1_none_owned_tokens", preprocess="none", input="owned", tokens=True),
        Case("v2_trainable_central_full", vpp=2, optimizer=True),
        Case("v2_trainable_owner_min_m5", vpp=2, backward="owner", overflow="min", micro=5),
        Case("v2_frozen_min_m1", vpp=2, preprocess="frozen", overflow="min", micro=1),
        Case(
            "v2_trainable_central_full_pynative", vpp=2, mode="pynative", same_as="v2_trainable_central_full"
        ),
        Case(
            "v1_trainable_owner_full_pynative",
            backward="owner",
            mode="pynative",
            same_as="v1_trainable_owner_full",
        ),
        Case("v2_none_owned_pynative", vpp=2, preprocess="none", input="owned", mode="pynative"),
    ],
    "p4": [
        Case("v1_trainable_central_full_m8", micro=8, optimizer=True),
        Case("v2_trainable_owner_full_m8", vpp=2, micro=8, backward="owner", twice=True),
        Case("v2_frozen_min_m6", vpp=2, preprocess="frozen", overflow="min", micro=6),
        Case("v1_none_owned_tokens", preprocess="none", input="owned", tokens=True),
        Case(
            "v2_trainable_central_min_owned_pynative", vpp=2, overflow="min", input="owned", mode="pynative"
        ),
    ],
}


class Checker:
    """Counts and prints comparisons without raising (ranks must stay in step)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures = 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"CHECK {name} {'OK' if ok else 'FAIL ' + detail}", flush=True)
        self.failures += not ok

    def losses(self, name: str, losses: list, expected: list[float]) -> None:
        got = np.array([float(loss.asnumpy()) for loss in losses])
        self.check(name, np.allclose(got, expected, atol=ATOL, rtol=RTOL), f"{got} vs {expected}")

    def close(
        self, name: str, actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], factor=1.0
    ) -> None:
        if set(actual) != set(expected):
            self.check(name, False, f"names differ: got {sorted(actual)}, expected {sorted(expected)}")
            return
        worst = ""
        for key in sorted(actual):
            if not np.allclose(actual[key], factor * expected[key], atol=ATOL, rtol=RTOL):
                worst = f"{key}: max |diff| {np.abs(actual[key] - factor * expected[key]).max():.3g}"
                break
        self.check(name, not worst, worst)


def owned_view(case: Case, pp: int, rank: int, x, size: int):
    """For owned input: blank every micro-batch this rank does not own (they must come by transfer)."""
    if case.input != "owned":
        return x
    config = PlanConfig(
        pp=pp,
        vpp=case.vpp,
        micro=case.micro,
        preprocess=case.preprocess,
        overflow=case.overflow,
        backward=case.backward,
        input="owned",
    )
    data = x.asnumpy().copy()
    per = size // case.micro
    for m in range(case.micro):
        if m not in config.owned(rank):
            data[m * per : (m + 1) * per] = 0
    from mindspore import Tensor

    return Tensor(data)


def grads_numpy(sched) -> dict[str, np.ndarray]:
    return {name: g.asnumpy().copy() for name, g in sched.grads().items()}


def run_case(case: Case, pp: int, rank: int, checker: Checker, results: dict) -> None:
    num_stages = pp * case.vpp
    model = build(num_stages, case.preprocess, tokens=case.tokens)
    ref = build(num_stages, case.preprocess, tokens=case.tokens)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    pre = model.preprocess
    sched = ge.ScheduleMPipeTranspose(
        stages,
        case.micro,
        pre,
        0 if pre is None else 1,
        mode=case.mode,
        overflow=case.overflow,
        backward=case.backward,
        input=case.input,
        loss_fn=loss_fn,
        scale_grads=case.scale_grads,
        timeout_s=120,
    )
    size = 2 * case.micro
    x, labels = batch(size, tokens=case.tokens)
    scale = 1.0 / case.micro if case.scale_grads else 1.0
    ref_losses, ref_grads = reference(ref, x, labels, case.micro, scale)
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if pre is not None and case.preprocess == "trainable" and (case.backward == "owner" or rank == 0):
        mine |= {p.name for p in pre.trainable_params()}
    expected = {k: v for k, v in ref_grads.items() if k in mine}

    losses = sched.run(owned_view(case, pp, rank, x, size), labels=labels)
    holds_last = rank == pp - 1
    checker.check(f"{case.name}.losses_where_expected", (losses is not None) == holds_last)
    if holds_last:
        checker.losses(f"{case.name}.losses", losses, ref_losses)
    grads = grads_numpy(sched)
    checker.close(f"{case.name}.grads", grads, expected)
    results[case.name] = grads
    if case.same_as is not None:
        checker.close(f"{case.name}.equals_{case.same_as}", grads, results[case.same_as])
    if case.twice:
        sched.run(owned_view(case, pp, rank, x, size), labels=labels)
        checker.close(f"{case.name}.accumulates_twice", grads_numpy(sched), expected, factor=2.0)
        sched.zero_grad()
        sched.run(owned_view(case, pp, rank, x, size), labels=labels)
        checker.close(f"{case.name}.zero_grad_then_run", grads_numpy(sched), expected)
    if case.optimizer:
        lr = 0.5
        params = sched.trainable_params()
        nn.SGD(params, learning_rate=lr)(tuple(sched.grads()[p.name] for p in params))
        sgd_step(ref.params(), ref_grads, lr)
        sched.zero_grad()
        losses = sched.run(owned_view(case, pp, rank, x, size), labels=labels)
        ref_losses, ref_grads = reference(ref, x, labels, case.micro, scale)
        if holds_last:
            checker.losses(f"{case.name}.after_step_losses", losses, ref_losses)
        checker.close(
            f"{case.name}.after_step_grads", grads_numpy(sched), {k: ref_grads[k] for k in expected}
        )
    allocations_before = sched.stats()["pool"].allocations
    sched.run(owned_view(case, pp, rank, x, size), labels=labels)
    checker.check(
        f"{case.name}.no_receive_allocation_after_warmup",
        sched.stats()["pool"].allocations == allocations_before,
    )


def main() -> int:
    prepare_mindspore("CPU")
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    results: dict = {}
    for case in SUITES[sys.argv[1]]:
        try:
            run_case(case, pp, rank, checker, results)
        except Exception:
            traceback.print_exc()
            checker.check(f"{case.name}.ran", False, "raised (traceback above)")
            return 1  # the message order is lost: the other ranks will report it too
    print(f"ALL DONE failures={checker.failures}", flush=True)
    return int(checker.failures > 0)


if __name__ == "__main__":
    sys.exit(main())
