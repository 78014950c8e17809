"""Re-price the verified plans of ``tune_sweep`` runs with the current calibration, from their logs.

A cost model is judged best on the same launches: re-running a sweep after changing the model
also changes the machine (here its speed moved 1.3-1.6x between hours). This reads each run's
calibration launches again (``logs/calibration_*``), derives the cost file as ``graph-exec
tune`` now would (:func:`graph_exec.cli.tune_example.from_launches`), prices every plan its
``--verify`` measured, and prints, per plan, the prediction printed then, the one now and the
measured step. Runs older than the ``V = 1`` calibration launch lack it; ``--v1-from-verify``
then takes the verify launch's fair baseline at ``V = 1`` and the first ``M`` in its place
(in sample for that one plan: said beside it).

Usage: ``python -m graph_exec.benchmarks.tune_replay DIR [--v1-from-verify]`` (DIR: a
``tune_sweep --out-dir`` or one run's directory). It runs nothing and takes seconds.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from graph_exec.benchmarks.common import argument_parser
from graph_exec.benchmarks.tune_sweep import PREDICTION_WITHIN
from graph_exec.cli.tune_example import Launch, from_launches, read_launch
from graph_exec.report.job import JobSpec
from graph_exec.tune import Candidate, ModelCosts, predict

_VERIFIED = re.compile(
    r"^ ?\d+\. (?P<plan>.+?) +predicted +(?P<predicted>[0-9.]+)  measured +(?P<measured>[0-9.]+)  "
)
_LAUNCH = re.compile(r"^calibration(_V\d+)?_M\d+$")  # calibration_M2 before the V = 1 launch


@dataclass(frozen=True)
class Repriced:
    """One verified plan: its prediction as printed, as re-priced now, and its measured step (ms)."""

    plan: str
    printed: float
    now: float
    measured: float
    in_sample: bool = False  #: its own launch served as the ``V = 1`` calibration


def parse_candidate(text: str) -> Candidate:
    """The :class:`Candidate` that :meth:`Candidate.describe` printed as ``text``."""
    schedule, *options = text.split()
    named = dict(option.split("=", 1) for option in options)
    return Candidate(
        schedule,
        named["split"],
        int(named["V"]),
        int(named["M"]),
        named.get("run_ahead", named.get("overflow", "full")),  # logs before the rename: overflow=
        named.get("backward", "central"),
        named["recompute"] == "on",
    )


def replay(run_dir: Path, v1_from_verify: bool = False) -> list[Repriced]:
    """Every verified plan of one ``tune --verify`` run, re-priced from its calibration logs."""
    costs = ModelCosts.load(run_dir / "costs.json")
    logs = run_dir / "logs"
    launches: list[tuple[Launch, float | None]] = []
    job = None
    for where in sorted(logs.iterdir()):
        if _LAUNCH.match(where.name) is not None:
            job = JobSpec.read(where / "job.json")
            launches.append(read_launch(job, where, costs.layers))
    if job is None:
        raise ValueError(f"no calibration launch under {logs}")
    launches.sort(key=lambda pair: (pair[0].vpp != 2, pair[0].micro))
    in_sample = None
    if v1_from_verify and all(launch.vpp != 1 for launch, _ in launches):
        first = launches[0][0].micro
        where = logs / f"verify_V1_M{first}"
        verify = JobSpec.read(where / "job.json") if where.exists() else None
        fair = [
            k
            for k, spec in enumerate(verify.runs if verify else ())
            if spec.baseline and spec.layers is None and not spec.recompute
        ]
        if fair:
            launches.append((read_launch(verify, where, costs.layers, fair[0])[0], None))
            in_sample = f"baseline split=even V=1 M={first} recompute=off"
    recompute = next((r for _, r in launches if r is not None), None)
    repriced = from_launches(costs, job.batch, [launch for launch, _ in launches], recompute)
    out = []
    lines = (run_dir / "output.txt").read_text(encoding="utf-8").split("verified (ms):", 1)[-1]
    for line in lines.splitlines():
        if (found := _VERIFIED.match(line)) is None:
            continue
        now = predict(repriced, job.pp, job.batch, parse_candidate(found["plan"])).step_time * 1e3
        plan = found["plan"]
        out.append(
            Repriced(plan, float(found["predicted"]), now, float(found["measured"]), plan == in_sample)
        )
    return out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


def _within(ratio: float) -> bool:
    return abs(ratio - 1) <= PREDICTION_WITHIN


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, "tune_replay")
    parser.add_argument("dir", type=Path, help="a tune_sweep --out-dir, or one run's directory")
    parser.add_argument(
        "--v1-from-verify",
        action="store_true",
        help="runs without a V=1 calibration launch: take the verify launch's fair baseline at V=1",
    )
    args = parser.parse_args(argv)
    runs = [
        run
        for run in ([args.dir] if (args.dir / "output.txt").exists() else sorted(args.dir.glob("*_run*")))
        if "verified (ms):" in _read(run / "output.txt")  # finished: a run still going is left out
    ]
    if not runs:
        parser.error(f"no tune run under {args.dir} (a directory with output.txt, costs.json and logs/)")
    every: list[Repriced] = []
    for run in runs:
        plans = replay(run, args.v1_from_verify)
        every += plans
        print(run.name)
        for p in plans:
            note = "  (in sample: its own launch was the V=1 calibration)" if p.in_sample else ""
            print(
                f"  {p.plan:<62} printed {p.printed:7.2f}  now {p.now:7.2f}  measured {p.measured:7.2f}  "
                f"measured/printed {p.measured / p.printed:.3f}  measured/now {p.measured / p.now:.3f}{note}"
            )
    for name, got in (
        ("printed", [p.measured / p.printed for p in every]),
        ("now", [p.measured / p.now for p in every]),
    ):
        print(
            f"{name:>7}: {sum(map(_within, got))}/{len(got)} plans within {PREDICTION_WITHIN:.0%}; "
            f"|measured/predicted - 1| median {statistics.median(abs(r - 1) for r in got):.3f}, "
            f"max {max(abs(r - 1) for r in got):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
