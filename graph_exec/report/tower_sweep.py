"""``graph-exec bench qwen2vl --tower-ratio R``: when MPipe pays off, against the best baselines.

For each tower ratio ``R`` the vision tower is scaled (its depth) so that its forward per
micro-batch is ``R`` times one even-split chunk's forward, as measured at start-up on this
machine. One launch per ``R`` trains, step by step in turn, four frozen-tower schedules:

- ``baseline-frozen``: the fair baseline (``ScheduleInterleaved1F1B``, tower on rank 0 right
  before ``F 0.m``), decoder layers split evenly;
- ``baseline-rebalanced``: the same with fewer decoder layers on rank 0's stages
  (:func:`graph_exec.balance.rebalanced_layers` from the measured layer and tower costs), the
  uneven first stage of Megatron-style VLM trainers;
- ``frozen-full`` and ``frozen-min``: MPipe, even split.

Besides the measured step times, every ``R`` is simulated at ``P`` ranks for each
:data:`SIMULATED_RANKS` from the costs that run measured (:func:`simulated`): per-layer
forward and backward from the even baseline's middle stages, stage 0's and the last stage's
extra work, the tower's forward (and in MPipe the shipping of its output), transfer latency and
bandwidth. A simulated ``P`` keeps the measured layers per chunk and micro-batches per rank
(``L' = L·P'/P``, ``M' = M·P'/P``): the model grows with the pipeline, as it does in practice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from graph_exec.balance import rebalanced_layers
from graph_exec.report.bench_report import RunResult
from graph_exec.schedule import PlanConfig, build_plan
from graph_exec.simulate import OpCosts, simulate

#: The schedules of one sweep point, in the order printed and plotted.
SCHEDULES = ("baseline-frozen", "baseline-rebalanced", "frozen-full", "frozen-min")
#: MPipe schedule -> its ``run_ahead``.
MPIPE = {"frozen-full": "full", "frozen-min": "min"}
SIMULATED_RANKS = (2, 4, 8)
#: The deepest tower a sweep builds: deeper means the calibration was off (its compile alone
#: would take minutes, and MindSpore's graph call depth stops near a thousand blocks).
MAX_VISION_DEPTH = 64


@dataclass(frozen=True)
class StartupCosts:
    """What the start-up calibration measured (seconds per micro-batch, graph mode, one core)."""

    chunk_forward: float  #: one even-split chunk's forward, as the pipeline runs it (taped)
    layer_step: float  #: one decoder layer's forward + backward, through the executor
    tower_fixed: float  #: the tower's forward without its blocks (patch embedding, merger)
    tower_block: float  #: one vision block's forward
    layers_per_chunk: int

    def depth_for(self, ratio: float) -> int:
        """Vision blocks whose tower forward is closest to ``ratio`` x a chunk's forward (>= 1).

        Raises ``ValueError`` beyond :data:`MAX_VISION_DEPTH` blocks, naming the costs."""
        depth = max(1, round((ratio * self.chunk_forward - self.tower_fixed) / self.tower_block))
        if depth > MAX_VISION_DEPTH:
            raise ValueError(
                f"--tower-ratio {ratio:g} needs {depth} vision blocks (chunk forward "
                f"{self.chunk_forward * 1e3:.2f} ms, one block {self.tower_block * 1e3:.3f} ms); at most "
                f"{MAX_VISION_DEPTH} are built: use a smaller ratio or rerun on a quieter machine"
            )
        return depth

    def tower(self, depth: int) -> float:
        return self.tower_fixed + depth * self.tower_block


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer and per-stage costs derived from a measured run (see :func:`layer_costs`)."""

    forward: float
    backward: float
    first_forward: float  #: stage 0's work besides its layers (embedding, image insertion)
    first_backward: float
    last_extra: float  #: the last stage's fused step besides its layers (norm, head, loss)
    last_backward: float  #: the last stage's ``B`` (hands the gradient on)
    base: OpCosts  #: everything else (transfers) as measured


def layer_costs(costs: OpCosts, layers: Sequence[int]) -> LayerCosts:
    """Split a run's measured per-stage costs into per-layer costs and stage extras.

    The per-layer forward and backward come from the stages between the first and the last
    (their ``F``/``B`` over their layer count); with no such stage, from stage 0.
    """
    last = len(layers) - 1
    middle = [s for s in range(1, last) if layers[s] > 0] or [s for s in (0,) if layers[0] > 0]
    if not middle:
        raise ValueError(f"no stage with decoder layers to measure a layer by: {list(layers)}")
    fwd = statistics.fmean(costs.forward_at(s) / layers[s] for s in middle)
    bwd = statistics.fmean(costs.backward_at(s) / layers[s] for s in middle)
    return LayerCosts(
        forward=fwd,
        backward=bwd,
        first_forward=max(0.0, costs.forward_at(0) - layers[0] * fwd),
        first_backward=max(0.0, costs.backward_at(0) - layers[0] * bwd),
        last_extra=max(0.0, costs.forward_at(last) - layers[last] * (fwd + bwd)),
        last_backward=costs.backward_at(last),
        base=costs,
    )


def stage_costs(c: LayerCosts, layers: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(stage_forward, stage_backward)`` of a split (the last stage's ``F`` is fused)."""
    last = len(layers) - 1
    forward = [n * c.forward for n in layers]
    backward = [n * c.backward for n in layers]
    forward[0] += c.first_forward
    backward[0] += c.first_backward
    forward[last] = (
        layers[last] * (c.forward + c.backward) + c.last_extra + (c.first_forward if last == 0 else 0.0)
    )
    backward[last] = c.last_backward
    return tuple(forward), tuple(backward)


def even(num_layers: int, num_stages: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if k < extra else 0) for k in range(num_stages))


def simulated(
    baseline: LayerCosts,
    mpipe: dict[str, OpCosts],
    tower: float,
    pp: int,
    vpp: int,
    micro: int,
    num_layers: int,
) -> dict[str, float]:
    """Simulated step time of every schedule of :data:`SCHEDULES` at ``pp`` ranks.

    ``baseline`` holds the even baseline run's layer costs (its ``TFWD`` is the tower's
    forward, ``tower``); ``mpipe`` each MPipe run's measured costs (their ``Pf`` includes
    shipping the tower's output, their transfers their own latency and bandwidth).
    """
    num_stages = pp * vpp
    even_split = even(num_layers, num_stages)
    extra = [tower + baseline.first_forward + baseline.first_backward] + [0.0] * (pp - 1)
    extra[-1] += baseline.last_extra
    balanced = rebalanced_layers(num_layers, pp, vpp, baseline.forward + baseline.backward, extra)
    out = {}
    for name, split in (("baseline-frozen", even_split), ("baseline-rebalanced", balanced)):
        forward, backward = stage_costs(baseline, split)
        costs = replace(
            baseline.base, stage_forward=forward, stage_backward=backward, preprocess_forward=tower
        )
        plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, preprocess="frozen", transpose=False))
        out[name] = simulate(plan, costs).step_time
    forward, backward = stage_costs(baseline, even_split)
    for name, run_ahead in MPIPE.items():
        if name not in mpipe:
            continue
        costs = replace(mpipe[name], stage_forward=forward, stage_backward=backward)
        plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, preprocess="frozen", run_ahead=run_ahead))
        out[name] = simulate(plan, costs).step_time
    return out


@dataclass(frozen=True)
class SweepPoint:
    """One tower ratio: what was built, measured and simulated."""

    ratio: float
    depth: int
    tower_s: float  #: the start-up estimate of the tower's forward
    rebalanced: tuple[int, ...]
    measured: dict[str, tuple[float, float, float]]  #: schedule -> (p10, p50, p90) step seconds
    simulated: dict[int, dict[str, float]]  #: ranks -> schedule -> step seconds
    pf_measured: float | None  #: the even baseline's median TFWD


def percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        position = (len(ordered) - 1) * q
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return at(0.1), at(0.5), at(0.9)


def sweep_point(
    ratio: float,
    depth: int,
    tower_s: float,
    rebalanced: tuple[int, ...],
    results: Sequence[RunResult],
    mode: str,
    pp: int,
    vpp: int,
    micro: int,
    num_layers: int,
) -> SweepPoint:
    """Evaluate one launch: measured percentiles and the simulations from its costs."""
    by_name = {r.spec.name: r for r in results}
    measured = {
        name: percentiles(by_name[f"{name}.{mode}"].summary.step_times)
        for name in SCHEDULES
        if f"{name}.{mode}" in by_name
    }
    base = by_name[f"baseline-frozen.{mode}"]
    costs = layer_costs(base.prediction.costs, even(num_layers, pp * vpp))
    mpipe = {
        name: by_name[f"{name}.{mode}"].prediction.costs for name in MPIPE if f"{name}.{mode}" in by_name
    }
    tower = base.prediction.costs.preprocess_forward
    sims = {
        ranks: simulated(costs, mpipe, tower, ranks, vpp, micro * ranks // pp, num_layers * ranks // pp)
        for ranks in SIMULATED_RANKS
    }
    return SweepPoint(ratio, depth, tower_s, rebalanced, measured, sims, base.pf)


def _speedup(base: float | None, value: float | None) -> str:
    if not base or not value:
        return "    -"
    return f"{base / value:5.2f}"


def table(points: Sequence[SweepPoint], costs: StartupCosts, pp: int) -> str:
    """The sweep as text: measured step times and speed-ups, then the simulations."""
    lines = [
        f"start-up costs (one core, per micro-batch): chunk forward {costs.chunk_forward * 1e3:.2f} ms "
        f"({costs.layers_per_chunk} layers), decoder layer forward+backward {costs.layer_step * 1e3:.2f} ms, "
        f"tower {costs.tower_fixed * 1e3:.2f} ms + {costs.tower_block * 1e3:.2f} ms per vision block",
        "",
        f"measured at P={pp} (step ms p10/p50/p90; x: speed-up of MPipe = baseline step / MPipe step)",
        f"{'R':>5s}{'depth':>6s}{'Pf ms':>7s}  {'rebalanced split':18s}"
        + "".join(f"{name:>22s}" for name in SCHEDULES)
        + f"{'full/even':>10s}{'full/rebal':>11s}{'min/even':>9s}{'min/rebal':>10s}",
    ]
    for p in points:
        cells = []
        for name in SCHEDULES:
            m = p.measured.get(name)
            cells.append(
                f"{'-':>22s}" if m is None else f"{m[0] * 1e3:8.1f}/{m[1] * 1e3:6.1f}/{m[2] * 1e3:6.1f}"
            )
        med = {name: m[1] for name, m in p.measured.items()}
        pf = "-" if p.pf_measured is None else f"{p.pf_measured * 1e3:.1f}"
        lines.append(
            f"{p.ratio:5.2g}{p.depth:6d}{pf:>7s}  {list(p.rebalanced)!s:18s}"
            + "".join(cells)
            + f"{_speedup(med.get('baseline-frozen'), med.get('frozen-full')):>10s}"
            + f"{_speedup(med.get('baseline-rebalanced'), med.get('frozen-full')):>11s}"
            + f"{_speedup(med.get('baseline-frozen'), med.get('frozen-min')):>9s}"
            + f"{_speedup(med.get('baseline-rebalanced'), med.get('frozen-min')):>10s}"
        )
    lines += ["", "simulated from each run's measured costs (step ms; speed-ups as above)"]
    lines.append(
        f"{'R':>5s}{'P':>3s}"
        + "".join(f"{name:>20s}" for name in SCHEDULES)
        + f"{'full/even':>10s}{'full/rebal':>11s}"
    )
    for p in points:
        for ranks, sim in p.simulated.items():
            lines.append(
                f"{p.ratio:5.2g}{ranks:3d}"
                + "".join(f"{sim[name] * 1e3:20.1f}" if name in sim else f"{'-':>20s}" for name in SCHEDULES)
                + f"{_speedup(sim.get('baseline-frozen'), sim.get('frozen-full')):>10s}"
                + f"{_speedup(sim.get('baseline-rebalanced'), sim.get('frozen-full')):>11s}"
            )
    return "\n".join(lines) + "\n"


def document(
    points: Sequence[SweepPoint], costs: StartupCosts, pp: int, vpp: int, micro: int
) -> dict[str, Any]:
    """Everything of the sweep as one JSON-able object."""
    return {
        "schema": "graph-exec-tower-sweep",
        "version": 1,
        "pp": pp,
        "vpp": vpp,
        "micro": micro,
        "startup_costs_s": costs.__dict__,
        "points": [
            {
                "ratio": p.ratio,
                "vision_depth": p.depth,
                "tower_estimate_s": p.tower_s,
                "tower_measured_s": p.pf_measured,
                "rebalanced_layers": list(p.rebalanced),
                "measured_s": {k: {"p10": v[0], "p50": v[1], "p90": v[2]} for k, v in p.measured.items()},
                "simulated_s": {str(k): v for k, v in p.simulated.items()},
            }
            for p in points
        ],
    }


def plot(points: Sequence[SweepPoint], path: Path, pp: int) -> None:
    """Step time against R, one line per schedule: measured at ``pp`` (solid, p10-p90 band)
    and simulated at the largest simulated P (dashed, on a second axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [p.ratio for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SCHEDULES:
        rows = [p.measured.get(name) for p in points]
        if all(r is None for r in rows):
            continue
        mid = [math.nan if r is None else r[1] * 1e3 for r in rows]
        line = left.plot(ratios, mid, marker="o", label=name)[0]
        left.fill_between(
            ratios,
            [math.nan if r is None else r[0] * 1e3 for r in rows],
            [math.nan if r is None else r[2] * 1e3 for r in rows],
            color=line.get_color(),
            alpha=0.15,
        )
        ranks = max(SIMULATED_RANKS)
        sim = [p.simulated[ranks].get(name, math.nan) * 1e3 for p in points]
        right.plot(ratios, sim, marker="s", linestyle="--", color=line.get_color(), label=name)
    left.set(xlabel="tower forward / chunk forward (R)", ylabel="step time (ms)", title=f"measured, P={pp}")
    right.set(
        xlabel="tower forward / chunk forward (R)",
        ylabel="step time (ms)",
        title=f"simulated, P={max(SIMULATED_RANKS)}",
    )
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ratios, [f"{r:g}" for r in ratios])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
