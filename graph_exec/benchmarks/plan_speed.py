"""Plan build + validation time (``build_plan`` always validates).

Run: ``python -m graph_exec.benchmarks.plan_speed``. Target: under 2 s for P=64, V=4, M=1024.
Prints the best of a few runs (wall clock and CPU time: on a shared machine the CPU time is
the steadier number) for a body-only plan and a trainable MPipe plan, and what turning one
rank's order into ``Step`` objects costs (``Plan.orders`` does that lazily, rank by rank).
"""

from __future__ import annotations

import time

from graph_exec.schedule import PlanConfig, build_plan

CASES = [
    PlanConfig(pp=64, vpp=4, micro=1024),
    PlanConfig(pp=64, vpp=4, micro=1024, preprocess="trainable"),
    PlanConfig(pp=8, vpp=2, micro=32),
    PlanConfig(pp=8, vpp=2, micro=32, preprocess="trainable"),
]
REPEATS = 3


def _best(config: PlanConfig) -> tuple[float, float, int]:
    """Best wall and CPU seconds of ``build_plan`` over ``REPEATS`` runs, and the step count."""
    walls, cpus = [], []
    steps = 0
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = build_plan(config)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        steps = sum(map(len, plan.order_codes))
    return min(walls), min(cpus), steps


def main() -> None:
    print(f"build_plan (build + validate), best of {REPEATS}:")
    for config in CASES:
        wall, cpu, steps = _best(config)
        print(
            f"  P={config.pp:<3} V={config.vpp} M={config.micro:<5} preprocess={config.preprocess:<9} "
            f"{steps:>9} steps  wall {wall:6.3f} s  cpu {cpu:6.3f} s"
        )
    plan = build_plan(CASES[0])
    start = time.perf_counter()
    plan.order(0)
    print(f"Step objects for one rank of P=64 V=4 M=1024: {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
