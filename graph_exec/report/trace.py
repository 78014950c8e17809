"""Pictures of a measured run: a chrome-trace document and a per-rank timeline plot.

Both place every rank's steps on the shared clock (see :mod:`graph_exec.report.records`), time
zero being the first rank entering the first step's ``run()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from graph_exec.report.analysis import COMPUTE_KINDS, kind_of
from graph_exec.report.records import RankRecord
from graph_exec.schedule import StepKind
from graph_exec.schedule.steps import BODY_KINDS

PLOT_EXTRA_HINT = "pip install -e '.[plot]' (in the root of the graph_exec clone)"


def category(token: str) -> str:
    """``compute`` (body F/B/I/W), ``preprocess`` (TFWD/TBWD/GRADrecv+bwd), ``p2p`` (body
    transfers), ``collective`` (BCAST/GRADreduce) or ``mpipe`` (preprocess transfers)."""
    kind = kind_of(token)
    if kind in (StepKind.F, StepKind.B, StepKind.I, StepKind.W):
        return "compute"
    if kind in COMPUTE_KINDS:
        return "preprocess"
    if kind in BODY_KINDS:
        return "p2p"
    if kind in (StepKind.BCAST, StepKind.GRADREDUCE):
        return "collective"
    return "mpipe"


def _origin(records: Sequence[RankRecord]) -> float:
    return min(r.steps[0].start for r in records if r.steps)


def chrome_trace(records: Sequence[RankRecord], title: str) -> dict:
    """Every rank's measured steps as one chrome://tracing / Perfetto document.

    One track (thread) per rank, plus a ``step k`` span per training step on each rank
    (its ``run()`` call), times in microseconds.
    """
    origin = _origin(records)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    for record in records:
        tid = record.rank
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"rank {tid}"}}
        )
        for step in record.steps:
            events.append(_span(f"step {step.step}", "step", tid, step.start - origin, step.end - step.start))
            events.extend(
                _span(e.token, category(e.token), tid, e.start - origin, e.seconds) for e in step.events
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _span(name: str, cat: str, tid: int, start: float, seconds: float) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": 0,
        "tid": tid,
        "ts": start * 1e6,
        "dur": seconds * 1e6,
    }


_COLOURS = {
    "compute": "tab:blue",
    "preprocess": "tab:orange",
    "p2p": "tab:gray",
    "mpipe": "tab:green",
    "collective": "tab:red",
}


def plot_timeline(records: Sequence[RankRecord], step_index: int, path: Path, title: str) -> None:
    """Draw one training step of every rank as horizontal bars (needs matplotlib).

    Raises ``ImportError`` with the install hint when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(f"--plot needs matplotlib: {PLOT_EXTRA_HINT}") from err
    steps = [r.steps[step_index] for r in records]
    origin = min(s.start for s in steps)
    span = max(s.end for s in steps) - origin
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(records)))
    for record, step in zip(records, steps, strict=True):
        y = len(records) - 1 - record.rank
        for event in step.events:
            start_ms, width_ms = (event.start - origin) * 1e3, event.seconds * 1e3
            colour = _COLOURS[category(event.token)]
            ax.barh(y, width_ms, left=start_ms, height=0.6, color=colour, edgecolor="white", linewidth=0.5)
            if width_ms > span * 1e3 / 40:
                ax.text(start_ms + width_ms / 2, y, event.token, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(records)), [f"rank {r.rank}" for r in reversed(records)])
    ax.set_xlabel("ms since the step started")
    ax.set_title(f"{title}: step {steps[0].step + 1}, {span * 1e3:.1f} ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
