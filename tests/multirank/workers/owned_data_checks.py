"""Owned input read through ``graph_exec.data.DataLoader(owned_by=schedule)`` on real ranks,
with ``tower_order="balanced"``, against replicated input and the non-pipelined reference.

Every rank builds the same model three times (owned input, replicated input, reference) and
reads the same shuffled data set: the owned schedule through an owned-input loader over a
source that records what this rank read and which sample sizes it computed, the replicated one
through a plain loader of the whole batch. Per step (two of them) each rank checks:

- the costs the loader exchanged equal the costs summed from the whole batch;
- it computed the sizes of exactly its share (every ``pp``-th micro-batch) and read exactly the
  samples of the micro-batches the schedule places on it, each once (all of them on the rank
  holding the last stage);
- the losses (last rank) and every gradient of the owned run equal the replicated run's and the
  reference's (atol 1e-5, rtol 1e-4: the placement changes the micro-batches' summation order).

It prints ``ORDER <case>.<step> <order>`` (the placement it decided), ``READ <case>.<step>
<micro-batches read>`` and ``BITWISE <case>.<step> <bool>`` (owned against replicated, every
gradient bit for bit) for the test to compare across ranks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.data import DataError, DataLoader, SampleError
from graph_exec.msenv import prepare_mindspore
from tests.models.common import announce_policy, loss_fn
from tests.models.pipeline import batch, build, reference
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

MICRO, PER = 4, 2
SIZE = MICRO * PER
#: Four batches per epoch; one sample in five is a heavy one (its tower costs 5, others 1).
SAMPLES = 4 * SIZE
COSTS = [5.0 if i % 5 == 0 else 1.0 for i in range(SAMPLES)]


@dataclass(frozen=True)
class Case:
    name: str
    preprocess: str
    vpp: int = 1
    mode: str = "graph"
    run_ahead: str = "full"
    failing: bool = False  #: rank 0's sample_cost fails: every rank must raise, none wait
    disagreeing: bool = False  #: rank 1's tower_costs differ by one rounding step: every rank raises


CASES = [
    Case("frozen_v1_graph", "frozen"),
    Case("trainable_v2_pynative", "trainable", vpp=2, mode="pynative"),
    Case("frozen_min_v1_graph", "frozen", run_ahead="min"),
]
FAILING = Case("failing_size", "frozen", failing=True)
#: Last: it fails a step, after which the ranks' message order is lost.
DISAGREEING = Case("disagreeing_costs", "frozen", disagreeing=True)
#: Costs whose balanced placement on the forward-only plan's own slack differs from the training
#: one at run_ahead="min" (the owned set of each rank changes): evaluate() must use the training one.
EVAL_COSTS = [10.0, 10.0, 10.0, 1.0]
#: Costs with a tie that one rounding step on one rank breaks the other way (run_ahead="full").
TIED_COSTS = [2.0, 6.0, 2.0, 6.0]


class Recording:
    """The data set's samples, recording which indices were read."""

    def __init__(self, samples: list) -> None:
        self.samples, self.read = samples, []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.samples[index]


def schedule(case: Case, model, rank: int, pp: int, input: str):
    num_stages = pp * case.vpp
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    return ge.ScheduleMPipeTranspose(
        stages,
        MICRO,
        model.preprocess,
        1,
        mode=case.mode,
        loss_fn=loss_fn,
        timeout_s=120,
        run_ahead=case.run_ahead,
        input=input,
        tower_order="balanced",
    )


def rows_of(indices: np.ndarray, micros) -> list[int]:
    return sorted(int(i) for m in micros for i in indices[m * PER : (m + 1) * PER])


def check_failing_size(case: Case, pp: int, rank: int, checker: Checker) -> None:
    """Rank 0 cannot size a sample: it raises the SampleError naming it, the other ranks learn of
    it from the same exchange and raise too (nobody waits for a rank that gave up)."""
    sched = schedule(case, build(pp, case.preprocess), rank, pp, "owned")
    x, labels = batch(SAMPLES, seed=4)
    samples = [(x.asnumpy()[i], labels.asnumpy()[i]) for i in range(SAMPLES)]
    check_micro_batches_refused(case, pp, rank, checker, x, labels)

    def sample_cost(index: int) -> float:
        if rank == 0:
            raise OSError("no image header")
        return 1.0

    loader = DataLoader(samples, SIZE, owned_by=sched, sample_cost=sample_cost, seed=3)
    try:
        loader.next_batch()
    except SampleError as exc:
        checker.check(f"{case.name}.raised", rank == 0 and "OSError: no image header" in str(exc), str(exc))
    except DataError as exc:
        checker.check(f"{case.name}.raised", rank != 0 and "1 other rank(s)" in str(exc), str(exc))
    else:
        checker.check(f"{case.name}.raised", False, "next_batch() returned")


def check_micro_batches_refused(case: Case, pp: int, rank: int, checker: Checker, x, labels) -> None:
    """``run(micro_batches=...)`` with owned input is refused on the rank, before it communicates
    (a schedule of its own: the refusal must not depend on, or disturb, the others)."""
    sched = schedule(case, build(pp * case.vpp, case.preprocess), rank, pp, "owned")
    rows = len(x) // MICRO
    pieces = [((x[k * rows : (k + 1) * rows],), labels[k * rows : (k + 1) * rows]) for k in range(MICRO)]
    try:
        sched.run(micro_batches=pieces, tower_costs=[1.0] * MICRO)  # balanced placement needs costs
    except ValueError as exc:
        refused = "with micro_batches= is not supported yet with input='owned'" in str(exc)
        checker.check(f"{case.name}.micro_batches_refused", refused, str(exc))
    else:
        checker.check(f"{case.name}.micro_batches_refused", False, "run() returned")


def check_disagreeing_costs(case: Case, pp: int, rank: int, checker: Checker) -> None:
    """Rank 1's ``tower_costs`` differ from rank 0's by one rounding step, enough to place the
    towers differently: the first transfer between them fails, on every rank, with an error
    naming both placements (nothing runs on mispaired rows, nobody waits for a timeout)."""
    sched = schedule(case, build(pp, case.preprocess), rank, pp, "owned")
    nudged = [*TIED_COSTS[:1], float(np.nextafter(TIED_COSTS[1], np.inf)), *TIED_COSTS[2:]]
    placements = {sched.placement(TIED_COSTS), sched.placement(nudged)}
    x, labels = batch(SIZE, seed=6)
    try:
        sched.run(x, labels=labels, tower_costs=nudged if rank == 1 else TIED_COSTS)
    except Exception as exc:  # the message is what is checked
        text = str(exc)
        named = all(f"order {order}" in text for order in placements)
        checker.check(f"{case.name}.raised", len(placements) == 2 and named and "disagree" in text, text)
    else:
        checker.check(f"{case.name}.raised", False, f"run() returned with placements {placements}")


def check_owned_evaluation(case: Case, owned, replicated, x, labels, rank: int, checker: Checker) -> None:
    """``evaluate()`` with owned input feeds each tower the rows the owned reading holds: the rows
    of the micro-batches placed elsewhere are blanked, the losses equal the replicated ones."""
    held = owned.owned_input(EVAL_COSTS)
    data = x.copy()
    for m in range(MICRO):
        if m not in held:
            data[m * PER : (m + 1) * PER] = 0
    got = owned.evaluate(Tensor(data), labels=Tensor(labels), tower_costs=EVAL_COSTS)
    want = replicated.evaluate(Tensor(x), labels=Tensor(labels), tower_costs=EVAL_COSTS)
    if owned.stages[-1].is_last:
        checker.losses(f"{case.name}.eval_losses_equal_replicated", got, [float(v.asnumpy()) for v in want])
    else:
        checker.check(f"{case.name}.eval_ran", got is None and want is None)


def run_case(case: Case, pp: int, rank: int, checker: Checker) -> None:
    if case.failing:
        check_failing_size(case, pp, rank, checker)
        return
    if case.disagreeing:
        check_disagreeing_costs(case, pp, rank, checker)
        return
    num_stages = pp * case.vpp
    owned_model, replicated_model, ref = (build(num_stages, case.preprocess) for _ in range(3))
    owned = schedule(case, owned_model, rank, pp, "owned")
    replicated = schedule(case, replicated_model, rank, pp, "replicated")
    x, labels = batch(SAMPLES, seed=4)
    samples = [(x.asnumpy()[i], labels.asnumpy()[i]) for i in range(SAMPLES)]
    source, sized = Recording(samples), []

    def sample_cost(index: int) -> float:
        sized.append(index)
        return COSTS[index]

    owned_loader = DataLoader(source, SIZE, owned_by=owned, sample_cost=sample_cost, seed=3)
    whole_loader = DataLoader(samples, SIZE, seed=3)
    trained = {p.name for p in owned.trainable_params()}
    for step in range(2):
        name = f"{case.name}.{step}"
        source.read.clear()
        sized.clear()
        ox, olabels = owned_loader.next_batch()
        indices = whole_loader.next_indices()
        wx, wlabels = whole_loader.next_batch()
        costs = [sum(COSTS[i] for i in indices[m * PER : (m + 1) * PER]) for m in range(MICRO)]
        checker.check(
            f"{name}.costs_exchanged", owned_loader.tower_costs == costs, f"{owned_loader.tower_costs}"
        )
        order = owned.placement(costs)
        print(f"ORDER {name} {','.join(map(str, order))}", flush=True)
        read = owned_loader.last_read
        print(f"READ {name} {','.join(map(str, read))}", flush=True)
        checker.check(f"{name}.read_what_is_placed_here", read == owned.owned_input(costs), f"{read}")
        checker.check(
            f"{name}.read_each_once", sorted(source.read) == rows_of(indices, read), f"{sorted(source.read)}"
        )
        checker.check(
            f"{name}.sized_its_share",
            sorted(sized) == rows_of(indices, range(rank, MICRO, pp)),
            f"{sorted(sized)}",
        )
        owned.zero_grad()
        replicated.zero_grad()
        owned_losses = owned.run(Tensor(ox), labels=Tensor(olabels), tower_costs=owned_loader.tower_costs)
        replicated_losses = replicated.run(Tensor(wx), labels=Tensor(wlabels), tower_costs=costs)
        ref_losses, ref_grads = reference(ref, Tensor(wx), Tensor(wlabels), MICRO)
        if owned.stages[-1].is_last:
            checker.losses(f"{name}.losses", owned_losses, ref_losses)
            checker.losses(
                f"{name}.losses_equal_replicated",
                owned_losses,
                [float(v.asnumpy()) for v in replicated_losses],
            )
        got, want = grads_numpy(owned), grads_numpy(replicated)
        checker.close(f"{name}.grads_equal_replicated", got, want)
        checker.close(f"{name}.grads", got, {k: v for k, v in ref_grads.items() if k in trained})
        bitwise = set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)
        print(f"BITWISE {name} {bitwise}", flush=True)
    check_owned_evaluation(case, owned, replicated, wx, wlabels, rank, checker)


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    return run_suite([*CASES, FAILING, DISAGREEING], lambda case: run_case(case, pp, rank, checker), checker)


if __name__ == "__main__":
    sys.exit(main())
