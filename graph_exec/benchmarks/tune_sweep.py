"""``graph-exec tune --verify`` over the examples and tower ratios that issue 41 names, repeated:
is the chosen plan's measured step within 10 % of its prediction, within 3 % of the fastest
verified candidate, and is MPipe chosen exactly where it measured faster than every baseline?

Each case is one ``graph-exec tune EXAMPLE --ranks P --verify`` (its own calibration, search and
verify launches; ranks pinned), run ``--repeats`` times in turn so that a drift of the machine
shows as spread rather than as a bias of one case. Per case it prints the three verdicts of each
run and the spread (min / median / max) of the chosen plan's measured/predicted, and of its
compute measured over calibrated (the verify table's ``compute``: where the two agree, the
error is in the per-step costs, e.g. a machine whose speed changed since the calibration).

Usage: ``python -m graph_exec.benchmarks.tune_sweep [--ranks 2] [--repeats 3]
[--cases vl_tower,embed_lm,qwen2vl:0.5,qwen2vl:1,qwen2vl:2,qwen2vl:4] [--out-dir DIR]`` (run
alone on the machine: it measures time). Each run's output, cost file and launch logs go to
``DIR/CASE_runK``; ``--summarize`` reads them again without running.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from graph_exec.benchmarks.common import argument_parser
from graph_exec.cli.tune_example import WITHIN

DEFAULT_CASES = "vl_tower,embed_lm,qwen2vl:0.5,qwen2vl:1,qwen2vl:2,qwen2vl:4"
#: Issue 41: the chosen plan's measured step within this share of its prediction.
PREDICTION_WITHIN = 0.10

_CHOSEN = re.compile(
    r"^ 1\. (?P<plan>.+?) +predicted +(?P<predicted>[0-9.]+)  measured +(?P<measured>[0-9.]+)  "
    r"measured/predicted (?P<ratio>[0-9.]+)(  compute (?P<compute>[0-9.]+))?$"
)
_WITHIN = re.compile(r"^chosen #1 is (?P<ratio>[0-9.]+)x the fastest verified: (?P<verdict>(NOT )?within)")
_MPIPE = re.compile(
    r"^MPipe .*: (?P<mpipe>[0-9.]+) against (?P<baseline>[0-9.]+) ms\); the search chose (?P<chose>\w+): "
    r"(?P<verdict>agrees|DISAGREES)"
)


@dataclass(frozen=True)
class Verdict:
    """What one ``tune --verify`` run printed about its choice."""

    plan: str
    predicted_ms: float
    measured_ms: float
    to_fastest: float  #: the chosen plan's measured step over the fastest verified
    mpipe_verdict: str  #: ``"agrees"``, ``"DISAGREES"`` or ``"-"`` (no baseline verified)
    compute: float | None = None  #: the chosen plan's measured compute over its calibrated compute
    mpipe_tie: bool = False  #: MPipe's and the baselines' best measured within ``tune``'s ``WITHIN``

    @property
    def measured_over_predicted(self) -> float:
        return self.measured_ms / self.predicted_ms


def parse(output: str) -> Verdict:
    """The verdict lines of one ``graph-exec tune --verify`` output."""
    chosen = within = mpipe = None
    for line in output.splitlines():
        chosen = chosen or _CHOSEN.match(line)
        within = within or _WITHIN.match(line)
        mpipe = mpipe or _MPIPE.match(line)
    if chosen is None or within is None:
        raise ValueError(f"no verify table in the output:\n{output[-3000:]}")
    return Verdict(
        plan=chosen["plan"],
        predicted_ms=float(chosen["predicted"]),
        measured_ms=float(chosen["measured"]),
        to_fastest=float(within["ratio"]),
        mpipe_verdict=mpipe["verdict"] if mpipe else "-",
        compute=float(chosen["compute"]) if chosen["compute"] else None,
        mpipe_tie=mpipe is not None and _apart(float(mpipe["mpipe"]), float(mpipe["baseline"])) <= WITHIN,
    )


def _apart(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


def command(case: str, ranks: int) -> list[str]:
    example, _, ratio = case.partition(":")
    argv = [sys.executable, "-m", "graph_exec.cli", "tune", example, "--ranks", str(ranks), "--verify"]
    argv += ["--steps", "20", "--warmup", "2"]
    return argv + (["--tower-ratio", ratio] if ratio else [])


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, "tune_sweep")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="EXAMPLE or qwen2vl:R, comma-separated")
    parser.add_argument(
        "--out-dir", type=Path, default=Path("tune-sweep"), help="each run's output and launch logs"
    )
    parser.add_argument(
        "--summarize", action="store_true", help="run nothing: summarize the runs already in --out-dir"
    )
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    results: dict[str, list[Verdict]] = {case: [] for case in cases}
    for repeat in range(1, args.repeats + 1):
        for case in cases:
            where = args.out_dir / f"{case.replace(':', '_R')}_run{repeat}"
            if not args.summarize:
                where.mkdir(parents=True, exist_ok=True)
                argv = [*command(case, args.ranks), "--log-dir", str(where / "logs")]
                argv += ["--save-costs", str(where / "costs.json")]
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                (where / "output.txt").write_text(done.stdout + done.stderr, encoding="utf-8")
                if done.returncode != 0:
                    print(f"{case} run {repeat}: tune failed (exit {done.returncode})\n{done.stderr[-3000:]}")
                    return 1
            verdict = parse((where / "output.txt").read_text(encoding="utf-8"))
            results[case].append(verdict)
            print(
                f"{case} run {repeat}: chose {verdict.plan}; predicted {verdict.predicted_ms:.2f} ms, "
                f"measured {verdict.measured_ms:.2f} ms ({verdict.measured_over_predicted:.3f}); "
                f"{verdict.to_fastest:.3f}x the fastest verified; MPipe choice {verdict.mpipe_verdict}"
                f"{' (a measured tie)' if verdict.mpipe_tie else ''}; "
                f"compute measured/calibrated {verdict.compute}",
                flush=True,
            )
    print(f"\nsummary, P={args.ranks}, {args.repeats} runs per case (measured/predicted min / median / max)")
    for case, verdicts in results.items():
        ratios = [v.measured_over_predicted for v in verdicts]
        close = sum(abs(r - 1) <= PREDICTION_WITHIN for r in ratios)
        fastest = sum(v.to_fastest <= WITHIN for v in verdicts)
        agrees = sum(v.mpipe_verdict != "DISAGREES" for v in verdicts)
        ties = sum(v.mpipe_verdict == "DISAGREES" and v.mpipe_tie for v in verdicts)
        print(
            f"{case:<12} {min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}; "
            f"within 10%: {close}/{len(verdicts)}; within {WITHIN:g}x of the fastest: {fastest}/{len(verdicts)}; "
            f"MPipe choice agrees: {agrees}/{len(verdicts)} ({agrees + ties}/{len(verdicts)} with measured "
            f"ties within {WITHIN:g}x); plans: {sorted({v.plan for v in verdicts})}"
        )
        computes = [v.compute for v in verdicts if v.compute is not None]
        if computes:
            print(
                f"{'':<12} its compute measured/calibrated: {min(computes):.3f} / "
                f"{statistics.median(computes):.3f} / {max(computes):.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
