"""The script msrun starts on every rank for ``graph-exec run`` and ``graph-exec bench``.

Usage (by the parent, never by hand): ``msrun … worker.py RUN_DIR``; the job is
``RUN_DIR/job.json``. msrun also starts a scheduler process running this script: nothing
happens before ``init()`` except imports and MindSpore settings, so it has no side effects.
A failure that a restart would meet again (ranks set up differently, a corrupt or mismatching
checkpoint) exits with :data:`graph_exec.restarts.EXIT_NOT_RETRYABLE`, so ``--max-restarts``
does not relaunch it.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from graph_exec.restarts import EXIT_NOT_RETRYABLE, NOT_RETRYABLE_ERRORS


def cores_for(rank: int, ranks: int, cores: list[int]) -> set[int]:
    """An equal share of ``cores`` for ``rank``: a contiguous block of ``len(cores) // ranks``
    cores when there are enough, else the single core ``rank mod len(cores)``."""
    share = len(cores) // ranks
    if share == 0:
        return {cores[rank % len(cores)]}
    return set(cores[rank * share : (rank + 1) * share])


def pin_cores(local_workers: int) -> None:
    """Bind this worker, and every thread it starts later, to its share of the cores.

    Called before MindSpore starts its thread pools, which inherit the binding. Ranks then do
    not steal each other's cores mid-kernel, so an op costs the same whatever the other ranks
    are doing, as for ranks that own their devices (measured here, 2 ranks on 2 cores: faster
    and far less noisy steps). The scheduler process msrun also starts is left alone.
    """
    if os.environ.get("MS_ROLE") == "MS_WORKER" and "RANK_ID" in os.environ:
        local_rank = int(os.environ["RANK_ID"]) % local_workers  # a host runs consecutive ranks
        os.sched_setaffinity(0, cores_for(local_rank, local_workers, sorted(os.sched_getaffinity(0))))


def main(argv: list[str]) -> int:
    from graph_exec.device import DevicePolicy
    from graph_exec.report.job import JOB_FILE, JobSpec

    run_dir = Path(argv[0])
    job = JobSpec.read(run_dir / JOB_FILE)
    local_workers = job.ranks // job.nodes
    if job.pin_cores and DevicePolicy.for_target(job.device).pin_cores:
        pin_cores(local_workers)
    from mindspore.communication import init

    from graph_exec.msenv import local_device_id, prepare_mindspore

    prepare_mindspore(job.device, device_id=local_device_id(job.device, local_workers), verbose=job.verbose)
    init()
    from graph_exec.report.status import announce

    announce("started")
    from graph_exec.harness.training import train

    try:
        train(job, run_dir)
    except NOT_RETRYABLE_ERRORS:  # what a relaunch would meet again
        traceback.print_exc()
        return EXIT_NOT_RETRYABLE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
