"""How big a plan will be, estimated from ``pp``, ``vpp`` and ``micro`` before anything is built.

A plan holds every rank's order as Python objects, built and validated in pure Python: about
22 µs and 100-250 bytes per step (measured on the development machine, build and validation
together; the simulator's timeline doubles it). ``--micro 100000000`` therefore asked for
about 600 million steps and took every byte of a 24 GiB machine before the kernel killed it.
:func:`check_plan_size` refuses such a configuration up front, by formula, so the refusal costs
nothing:

- **steps**: every (stage, micro-batch) pair has an ``F`` and a ``B``, each with at most one
  receive and one send: at most ``6 P V M``; the MPipe layer adds at most 8 steps per
  micro-batch (``TFWD``, ``OUT*``, ``IN*``, ``TBWD``, ``GRAD*``) and 4 per rank (``BCAST``,
  ``GRADreduce``): :func:`estimate_steps` is an upper bound of the executable orders (with
  ``pp = 1``, no transfers: ``2 V M + 2 M + 4``);
- **the limit**: at most :data:`MAX_PLAN_STEPS` steps, and the estimated bytes
  (``steps x bytes per step``, :data:`BUILD_BYTES_PER_STEP` to build,
  :data:`SIMULATE_BYTES_PER_STEP` to simulate) at most :data:`MEMORY_FRACTION` of the
  machine's physical memory (``os.sysconf``; :data:`FALLBACK_MEMORY_BYTES` where it cannot be
  read). The largest benchmarked plan (``pp=64, vpp=4, micro=1024``, 1.6 million steps) is a
  tenth of the step limit.

Pure Python, like the rest of the schedule layer.
"""

from __future__ import annotations

import os

from graph_exec.schedule.config import PlanConfig, PlanConfigError

#: The most steps (upper estimate, :func:`estimate_steps`) a plan may have: about six minutes
#: and 3 GiB to build and validate.
MAX_PLAN_STEPS = 16_000_000

#: Bytes one step costs while a plan is built and validated (measured 100-180, rounded up).
BUILD_BYTES_PER_STEP = 200

#: Bytes one step costs in a simulation: the plan, its fair baseline and the timeline
#: (measured up to 250, rounded up).
SIMULATE_BYTES_PER_STEP = 400

#: The share of the machine's physical memory a plan may take.
MEMORY_FRACTION = 0.25

#: The memory assumed where ``os.sysconf`` cannot tell (8 GiB: a quarter of it is 2 GiB).
FALLBACK_MEMORY_BYTES = 8 << 30


class PlanTooLargeError(PlanConfigError):
    """A configuration whose plan would take more steps or memory than :mod:`.size` allows."""


def estimate_steps(config: PlanConfig) -> int:
    """An upper bound of the steps in every rank's order together (see the module docstring)."""
    if config.pp == 1:  # no transfers: F and B of each pair, TFWD and TBWD of each micro-batch
        return 2 * config.num_stages * config.micro + 2 * config.micro + 4
    return 6 * config.num_stages * config.micro + 8 * config.micro + 4 * config.pp


def physical_memory_bytes() -> int:
    """This machine's physical memory (``os.sysconf``), or :data:`FALLBACK_MEMORY_BYTES`."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_MEMORY_BYTES
    return pages * page_size if pages > 0 and page_size > 0 else FALLBACK_MEMORY_BYTES


def check_plan_size(
    config: PlanConfig, bytes_per_step: int = BUILD_BYTES_PER_STEP, what: str = "building the plan"
) -> int:
    """Raise :class:`PlanTooLargeError` when ``config``'s plan is over the limits of the module
    docstring; else return its estimated steps. Nothing is built."""
    steps = estimate_steps(config)
    allowed = int(physical_memory_bytes() * MEMORY_FRACTION)
    needed = steps * bytes_per_step
    if steps <= MAX_PLAN_STEPS and needed <= allowed:
        return steps
    limit = (
        f"the limit is {MAX_PLAN_STEPS:,} steps"
        if steps > MAX_PLAN_STEPS
        else f"{MEMORY_FRACTION:.0%} of this machine's memory is {allowed / 2**30:.1f} GiB"
    )
    per_micro = 2 * config.num_stages + 2 if config.pp == 1 else 6 * config.num_stages + 8
    fits = max((min(MAX_PLAN_STEPS, allowed // bytes_per_step) - 4 * config.pp) // per_micro, 0)
    raise PlanTooLargeError(
        f"pp={config.pp}, vpp={config.vpp}, micro={config.micro}: {what} would take about "
        f"{steps:,} steps and {needed / 2**30:.1f} GiB; {limit}. Use fewer micro-batches "
        f"(about {fits:,} at most with pp={config.pp}, vpp={config.vpp}) or fewer stages"
    )
