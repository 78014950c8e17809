"""A job re-planned on another number of ranks, so that its checkpoint still loads by name.

A restart that cannot get back every rank (a lost device, a smaller allocation) may go on with
fewer (``graph-exec run --min-ranks``). What must stay is what the checkpoint's numbers mean:
the model (so its stage count ``P x V`` and the split of blocks over the stages), the global
batch (the data position counts global batches) and everything a step computes. What may change
is how the stages are laid out: the pipeline ranks ``P``, the replicas ``D`` and the
micro-batches ``M``. The plan chosen is the one with the largest ``P`` that divides both the
stage count and the ranks (the fewest replicas: the least data-parallel traffic, and each rank
keeps ``V`` as low as the stage count allows), with ``M`` keeping the rows of a micro-batch
(its activation memory) where the global batch allows, else the old ``M``.

Pure Python over :class:`~graph_exec.report.job.JobSpec`: no MindSpore, no msrun.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

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
        micros = list(_micros(job, ranks // pp))
        if not micros:
            tried.append(f"D={ranks // pp} P={pp} V={stages // pp}: no M with D x M dividing {job.batch}")
        for micro in micros:
            candidate = dataclasses.replace(job, ranks=ranks, dp=ranks // pp, vpp=stages // pp, micro=micro)
            why = _unfit(candidate)
            if why is None:
                return candidate
            tried.append(f"D={ranks // pp} P={pp} V={stages // pp} M={micro}: {why}")
    raise ReplanError(
        f"no plan of the job's {stages} stages and global batch {job.batch} fits {ranks} ranks "
        f"(P must divide both {stages} and {ranks}, D = {ranks}/P must divide the batch over M "
        f"micro-batches): {'; '.join(tried)}"
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


def _micros(job: JobSpec, dp: int) -> Iterator[int]:
    """The micro-batch counts to try with ``dp`` replicas: the one keeping the rows of a
    micro-batch, then the job's own; each only where ``dp x M`` divides the global batch."""
    rows = job.batch // (job.dp * job.micro)
    keep_rows = job.batch // (dp * rows) if job.batch % (dp * rows) == 0 else None
    seen = set()
    for micro in (keep_rows, job.micro):
        if micro and micro not in seen and job.batch % (dp * micro) == 0:
            seen.add(micro)
            yield micro


def _unfit(job: JobSpec) -> str | None:
    """Why ``job``'s plans cannot be built (``None``: they can), checked as the CLI checks them."""
    for spec in job.runs:
        try:
            check_plan_size(job.plan_config(spec), what="every rank's plan")
        except PlanConfigError as error:
            return str(error)
    return None
