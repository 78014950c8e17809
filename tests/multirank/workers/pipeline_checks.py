"""Run many pipeline configurations in one msrun job and check each against the reference.

Communication init costs seconds, so one launch covers a whole suite. Every rank builds the
whole model (same seed, identical weights), keeps its own chunks, runs the pipeline, and
compares what it holds — per-micro losses on the last rank, every gradient it trains — with a
single-process, non-pipelined reference it computes itself (atol 1e-5, rtol 1e-4). Every
``run()`` gets a batch of its own (seeded by the step number, so all ranks agree), so a stale
receive buffer or a cached activation from an earlier step shows up as wrong numbers. A failed
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
from tests.models.common import ATOL, RTOL, announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference, sgd_step


@dataclass(frozen=True)
class Case:
    name: str
    vpp: int = 1
    micro: int = 4
    preprocess: str = "trainable"  # trainable | frozen | none
    run_ahead: str = "full"
    backward: str = "central"
    input: str = "replicated"
    mode: str = "graph"
    tokens: bool = False
    scale_grads: bool = False
    twice: bool = False  # second run() without zero_grad accumulates twice the gradient
    optimizer: bool = False  # SGD step, then a second step compared with the reference doing the same
    same_as: str | None = None  # gradients must equal that earlier case's (graph vs pynative)
    sync_steps: bool | None = None  # None: the default (on for CPU); False: asynchronous dispatch
    schedule: str = "mpipe"  # mpipe | interleaved (ScheduleInterleaved1F1B, no preprocess) | baseline
    # (baseline: ScheduleInterleaved1F1B with the preprocess, the fair baseline)
    recompute: bool = False  # keep only stage inputs and record the forward again in the backward
    keep_tape: bool = False  # keep_preprocess_tape: TFWD taped where its backward runs, no recompute
    body: str = "interleaved"  # the schedules' body option ("zb": split backward, I and W steps)


SUITES: dict[str, list[Case]] = {
    "p2": [
        Case("v1_trainable_central_full", twice=True, optimizer=True),
        Case("v1_trainable_central_min_owned", run_ahead="min", input="owned"),
        Case("v1_trainable_owner_full", backward="owner", twice=True, optimizer=True, sync_steps=False),
        Case("v1_frozen_full_m3", preprocess="frozen", micro=3),
        Case("v1_none_replicated", preprocess="none", scale_grads=True),
        Case("v1_none_owned_tokens", preprocess="none", input="owned", tokens=True),
        Case("v2_trainable_central_full", vpp=2, optimizer=True),
        Case(
            "v2_trainable_owner_min_m5", vpp=2, backward="owner", run_ahead="min", micro=5, sync_steps=False
        ),
        Case("v2_frozen_min_m1", vpp=2, preprocess="frozen", run_ahead="min", micro=1),
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
        Case("i1f1b_v2_graph", schedule="interleaved", vpp=2, preprocess="none", twice=True, optimizer=True),
        Case(
            "i1f1b_v2_pynative",
            schedule="interleaved",
            vpp=2,
            preprocess="none",
            mode="pynative",
            same_as="i1f1b_v2_graph",
        ),
        Case("i1f1b_v1_graph_async_m3", schedule="interleaved", preprocess="none", micro=3, sync_steps=False),
    ],
    "p4": [
        Case("v1_trainable_central_full_m8", micro=8, optimizer=True),
        Case("v2_trainable_owner_full_m8", vpp=2, micro=8, backward="owner", twice=True, sync_steps=False),
        Case("v2_frozen_min_m6", vpp=2, preprocess="frozen", run_ahead="min", micro=6),
        Case("v1_none_owned_tokens", preprocess="none", input="owned", tokens=True),
        Case(
            "v2_trainable_central_min_owned_pynative", vpp=2, run_ahead="min", input="owned", mode="pynative"
        ),
        Case(
            "i1f1b_v2_graph_async_m8",
            schedule="interleaved",
            vpp=2,
            micro=8,
            preprocess="none",
            optimizer=True,
            sync_steps=False,
        ),
        Case("i1f1b_v1_pynative", schedule="interleaved", preprocess="none", mode="pynative", twice=True),
    ],
    # The non-default backward options, with the same checks: recompute=True (the forward is
    # recorded again in the backward) and keep_preprocess_tape=True (no preprocess recompute).
    "backward_options": [
        Case("graph_v1_trainable_central", recompute=True),
        Case(
            "pynative_v1_trainable_central",
            mode="pynative",
            recompute=True,
            same_as="graph_v1_trainable_central",
        ),
        Case(
            "graph_v2_trainable_owner_min", vpp=2, backward="owner", run_ahead="min", micro=5, recompute=True
        ),
        Case(
            "pynative_v2_trainable_owner_min",
            vpp=2,
            backward="owner",
            run_ahead="min",
            micro=5,
            mode="pynative",
            recompute=True,
            same_as="graph_v2_trainable_owner_min",
        ),
        Case(
            "graph_v2_none_owned_tokens", vpp=2, preprocess="none", input="owned", tokens=True, recompute=True
        ),
        Case("graph_baseline_v2", vpp=2, preprocess="none", schedule="interleaved", recompute=True),
        Case(
            "pynative_baseline_v2",
            vpp=2,
            preprocess="none",
            schedule="interleaved",
            mode="pynative",
            recompute=True,
            same_as="graph_baseline_v2",
        ),
        Case("tape_v1_owner_full", backward="owner", keep_tape=True, twice=True, optimizer=True),
        Case(
            "tape_v1_owner_full_pynative",
            backward="owner",
            keep_tape=True,
            mode="pynative",
            same_as="tape_v1_owner_full",
        ),
        Case("tape_v2_central_full", vpp=2, keep_tape=True, optimizer=True),
        Case(
            "tape_v2_owner_min_m5",
            vpp=2,
            backward="owner",
            run_ahead="min",
            micro=5,
            keep_tape=True,
            sync_steps=False,
        ),
    ],
}


# The split backward (body="zb": I and W steps) with the same checks, in one launch per world size.
SUITES["zb_p2"] = [
    Case("zb_v1_trainable_central_full", body="zb", twice=True, optimizer=True),
    Case("zb_v1_trainable_owner_full", body="zb", backward="owner", twice=True, sync_steps=False),
    Case("zb_v1_frozen_min_m3", body="zb", preprocess="frozen", run_ahead="min", micro=3),
    Case("zb_v1_none_scaled", body="zb", preprocess="none", scale_grads=True),
    Case("zb_v2_trainable_central_full_m5", body="zb", vpp=2, micro=5, optimizer=True),
    Case("zb_v2_trainable_owner_min_m5", body="zb", vpp=2, backward="owner", run_ahead="min", micro=5),
    Case(
        "zb_v1_trainable_central_full_pynative",
        body="zb",
        mode="pynative",
        same_as="zb_v1_trainable_central_full",
    ),
    Case(
        "zb_v2_trainable_owner_min_m5_pynative",
        body="zb",
        vpp=2,
        backward="owner",
        run_ahead="min",
        micro=5,
        mode="pynative",
        same_as="zb_v2_trainable_owner_min_m5",
    ),
    Case("zb_baseline_v2_trainable", body="zb", vpp=2, schedule="baseline", twice=True),
    Case("zb_baseline_v1_trainable_pynative", body="zb", schedule="baseline", mode="pynative"),
    Case("zb_i1f1b_v2", body="zb", vpp=2, schedule="interleaved", preprocess="none", optimizer=True),
]
SUITES["zb_p4"] = [
    Case("zb_v1_trainable_central_full_m8", body="zb", micro=8, optimizer=True),
    Case("zb_v2_trainable_owner_full_m8", body="zb", vpp=2, micro=8, backward="owner", twice=True),
    Case("zb_v2_frozen_min_m6", body="zb", vpp=2, preprocess="frozen", run_ahead="min", micro=6),
    Case("zb_v2_trainable_central_full_pynative", body="zb", vpp=2, mode="pynative"),
    Case("zb_v1_trainable_owner_full_m3_pynative", body="zb", micro=3, backward="owner", mode="pynative"),
    Case("zb_baseline_v2_trainable_m8", body="zb", vpp=2, micro=8, schedule="baseline"),
    Case("zb_i1f1b_v1_pynative", body="zb", schedule="interleaved", preprocess="none", mode="pynative"),
]


def _pick(suite: str, names: list[str]) -> list[Case]:
    """The cases of ``suite`` named ``names``, in that order."""
    by_name = {case.name: case for case in SUITES[suite]}
    return [by_name[name] for name in names]


# The device path (GRAPH_EXEC_CPU_FAST_PATHS=0, tests/multirank/test_device_path.py): asynchronous
# dispatch makes CPU steps several times slower, so it runs a share of the suites above that still
# covers both schedules, both modes, central and owner backward, every preprocess kind, owned
# input, recompute and keep_preprocess_tape, accumulation over two runs and an optimizer step.
SUITES["device_p2"] = _pick(
    "p2",
    [
        "v1_trainable_central_full",
        "v1_trainable_owner_full",
        "v1_trainable_owner_full_pynative",
        "v1_frozen_full_m3",
        "v2_trainable_owner_min_m5",
        "v1_none_owned_tokens",
        "i1f1b_v2_graph",
        "i1f1b_v2_pynative",
    ],
) + _pick(
    "backward_options",
    ["graph_v1_trainable_central", "pynative_v1_trainable_central", "tape_v2_central_full"],
)
SUITES["device_p4"] = _pick(
    "p4", ["v2_trainable_owner_full_m8", "v2_trainable_central_min_owned_pynative", "i1f1b_v2_graph_async_m8"]
)


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


def run_suite(cases, run_one, checker: Checker) -> int:
    """Run ``run_one(case)`` for every case in order and return the worker's exit status; a case
    that raises ends the suite, since the ranks' message order is then lost (the other ranks
    report it too)."""
    for case in cases:
        try:
            run_one(case)
        except Exception:
            traceback.print_exc()
            checker.check(f"{case.name}.ran", False, "raised (traceback above)")
            return 1
    print(f"ALL DONE failures={checker.failures}", flush=True)
    return int(checker.failures > 0)


def owned_view(case: Case, pp: int, rank: int, x, size: int):
    """For owned input: blank every micro-batch this rank does not own (they must come by transfer)."""
    if case.input != "owned":
        return x
    config = PlanConfig(
        pp=pp,
        vpp=case.vpp,
        micro=case.micro,
        preprocess=case.preprocess,
        run_ahead=case.run_ahead,
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


def make_schedule(case: Case, stages: list, pre) -> object:
    common = dict(
        mode=case.mode,
        loss_fn=loss_fn,
        scale_grads=case.scale_grads,
        timeout_s=120,
        sync_steps=case.sync_steps,
        recompute=case.recompute,
        body=case.body,
    )
    if case.schedule == "interleaved":
        return ge.ScheduleInterleaved1F1B(stages, case.micro, **common)
    if case.schedule == "baseline":
        return ge.ScheduleInterleaved1F1B(stages, case.micro, pre, 0 if pre is None else 1, **common)
    return ge.ScheduleMPipeTranspose(
        stages,
        case.micro,
        pre,
        0 if pre is None else 1,
        run_ahead=case.run_ahead,
        backward=case.backward,
        input=case.input,
        keep_preprocess_tape=case.keep_tape,
        **common,
    )


def run_case(case: Case, pp: int, rank: int, checker: Checker, results: dict) -> None:
    num_stages = pp * case.vpp
    model = build(num_stages, case.preprocess, tokens=case.tokens)
    ref = build(num_stages, case.preprocess, tokens=case.tokens)
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    pre = model.preprocess
    sched = make_schedule(case, stages, pre)
    size = 2 * case.micro
    scale = 1.0 / case.micro if case.scale_grads else 1.0
    mine = {p.name for s in stages for p in s.submodule.trainable_params()}
    if pre is not None and case.preprocess == "trainable" and (case.backward == "owner" or rank == 0):
        mine |= {p.name for p in pre.trainable_params()}
    holds_last = rank == pp - 1
    steps = iter(range(100, 200))  # the batch seed of each run(): a new batch every step

    def step(label: str) -> dict[str, np.ndarray]:
        """One ``run()`` on a fresh batch; checks its losses, returns the reference gradients
        of the parameters this rank trains (all of them in ``full``, for the optimizer)."""
        nonlocal full
        x, labels = batch(size, tokens=case.tokens, seed=next(steps))
        ref_losses, full = reference(ref, x, labels, case.micro, scale)
        losses = sched.run(owned_view(case, pp, rank, x, size), labels=labels)
        checker.check(f"{case.name}.{label}losses_where_expected", (losses is not None) == holds_last)
        if holds_last:
            checker.losses(f"{case.name}.{label}losses", losses, ref_losses)
        return {k: v for k, v in full.items() if k in mine}

    full: dict[str, np.ndarray] = {}
    expected = step("")
    grads = grads_numpy(sched)
    checker.close(f"{case.name}.grads", grads, expected)
    results[case.name] = grads
    if case.same_as is not None:
        checker.close(f"{case.name}.equals_{case.same_as}", grads, results[case.same_as])
    if case.twice:
        second = step("second_")
        total = {k: expected[k] + second[k] for k in expected}
        checker.close(f"{case.name}.accumulates_over_two_batches", grads_numpy(sched), total)
        sched.zero_grad()
        expected = step("after_zero_grad_")
        checker.close(f"{case.name}.zero_grad_then_run", grads_numpy(sched), expected)
    if case.optimizer:
        lr = 0.5
        params = sched.trainable_params()
        nn.SGD(params, learning_rate=lr)(tuple(sched.grads()[p.name] for p in params))
        # Every rank's step together (and the broadcast of the preprocess) update the whole model.
        sgd_step(ref.params(), full, lr)
        sched.zero_grad()
        expected = step("after_step_")
        checker.close(f"{case.name}.after_step_grads", grads_numpy(sched), expected)
    sched.zero_grad()
    allocations_before = sched.stats()["pool"].allocations
    expected = step("last_")
    checker.close(f"{case.name}.last_grads", grads_numpy(sched), expected)
    checker.check(
        f"{case.name}.no_receive_allocation_after_warmup",
        sched.stats()["pool"].allocations == allocations_before,
    )
    checker.check(f"{case.name}.nothing_kept", not sched._setup.executor.kept())
    if case.body == "zb":
        check_split(case, sched, checker)


def check_split(case: Case, sched, checker: Checker) -> None:
    """What ran under body="zb": one I and one W per local stage and micro-batch, no B, and each
    W after its I (the last stage's I only ships what its fused F computed)."""
    tokens = [event.step for event in sched.timeline]
    computed = [
        t for t in tokens if t[:1] in ("B", "I", "W") and not t.startswith(("Brecv", "Bsend", "BCAST"))
    ]
    local = len(sched.stages) * case.micro
    inputs = [t[1:] for t in computed if t[0] == "I"]
    weights = [t[1:] for t in computed if t[0] == "W"]
    ok = (
        not any(t[0] == "B" for t in computed)
        and len(inputs) == len(weights) == local
        and sorted(inputs) == sorted(weights)
        and all(tokens.index("I" + k) < tokens.index("W" + k) for k in inputs)
    )
    checker.check(f"{case.name}.split_backward_ran", ok, f"{computed}")


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    results: dict = {}
    print(f"SUITE {sys.argv[1]} cases: {' '.join(case.name for case in SUITES[sys.argv[1]])}", flush=True)
    return run_suite(SUITES[sys.argv[1]], lambda case: run_case(case, pp, rank, checker, results), checker)


if __name__ == "__main__":
    sys.exit(main())
