"""A job re-planned on another number of ranks, so that its checkpoint still loads by name.

A restart that cannot get back every rank (a lost device, a smaller allocation) may go on with
fewer (``graph-exec run --min-ranks``). What must stay is what the checkpoint's numbers mean:
the model (so its stage count ``P x V`` and the split of blocks over the stages), the global
batch (the data position counts global batches) and everything a step computes. What may change
is how the stages are laid out: the pipeline ranks ``P`` and the replicas ``D``. The plan
chosen is the one with the largest ``P`` that divides both the stage count and the ranks (the
fewest replicas: the least data-parallel traffic, and each rank keeps ``V`` as low as the stage
count allows).

The micro-batch count ``M`` of a replica stays too: the schedules sum the micro-batches'
gradients (``scale_grads=False``), so a step's gradient is ``M`` times the mean one, and Adam's
saved moments were accumulated at the old scale. A relaunch at another ``M`` trains on (measured
on ``embed_lm``: ``M`` 4 -> 8 at D 1 put step 5's loss 3e-4 off the uninterrupted run, Adam's
second moments 2-3x off by step 6), but it does not continue the run. With ``M`` kept, a replica's
micro-batches hold ``batch / (D x M)`` rows: fewer replicas, larger micro-batches.

Pure Python over :class:`~graph_exec.report.job.JobSpec`: no MindSpore, no msrun.
"""

from __future__ import annotations

import dataclasses
import math

from graph_exec.report.job import JobSpec
from graph_exec.schedule import PlanConfigError, check_plan_size


class ReplanError(ValueError):
    """No plan of the job's stage count and global batch fits the ranks; names what was tried."""


def plan_on(job: JobSpec, ranks: int) -> JobSpec:
    """``job`` laid out on ``ranks`` ranks (see the module docstring); raises :class:`ReplanError`."""
    if ranks < 1:
        raise ReplanError(f"cannot plan on {ranks} ranks: at least 1 is needed")
    stages = job.pp * job.vpp
    if ranks == job.ranks:
        return job
    tried = []
    for pp in sorted(_divisors(math.gcd(stages, ranks)), reverse=True):
        dp, where = ranks // pp, f"D={ranks // pp} P={pp} V={stages // pp}"
        if job.batch % (dp * job.micro):
            tried.append(f"{where}: D x M = {dp} x {job.micro} does not divide the global batch {job.batch}")
            continue
        candidate = dataclasses.replace(job, ranks=ranks, dp=dp, vpp=stages // pp)
        why = _unfit(candidate)
        if why is None:
            return candidate
        tried.append(f"{where}: {why}")
    raise ReplanError(
        f"no plan of the job's {stages} stages and global batch {job.batch} fits {ranks} ranks "
        f"(P must divide both {stages} and {ranks}, and D = {ranks}/P times the job's M = {job.micro} "
        f"must divide the batch): {'; '.join(tried)}"
    )


def plan_on_fewer(job: JobSpec, usable: int, min_ranks: int) -> JobSpec:
    """``job`` on the most ranks in ``[min_ranks, usable]`` that a plan fits (all of its own
    when ``usable`` covers them); raises :class:`ReplanError` when none does."""
    if usable >= job.ranks:
        return job
    if usable < min_ranks:
        raise ReplanError(
            f"only {usable} rank{'s' if usable != 1 else ''} usable, fewer than --min-ranks {min_ranks}"
        )
    errors = []
    for ranks in range(usable, min_ranks - 1, -1):
        try:
            return plan_on(job, ranks)
        except ReplanError as error:
            errors.append(str(error))
    raise ReplanError(f"{usable} usable ranks (--min-ranks {min_ranks}): " + "; ".join(errors))


def layout(job: JobSpec) -> str:
    """``(D=2, P=2, V=2, M=4)``: how a job lays its stages out."""
    return f"(D={job.dp}, P={job.pp}, V={job.vpp}, M={job.micro})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _unfit(job: JobSpec) -> str | None:
    """Why ``job``'s plans cannot be built (``None``: they can), checked as the CLI checks them."""
    for spec in job.runs:
        try:
            check_plan_size(job.plan_config(spec), what="every rank's plan")
        except PlanConfigError as error:
            return str(error)
    return None
