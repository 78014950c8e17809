"""``graph-exec bench`` prints each run's step-time spread (p10 and p90 next to the median)."""

from collections import defaultdict

import pytest

from graph_exec.report.bench_report import _percentile, table


def test_percentile_interpolates_between_sorted_steps() -> None:
    steps = [0.5, 0.1, 0.2, 0.4, 0.3]
    assert _percentile(steps, 50) == pytest.approx(0.3)
    assert _percentile(steps, 10) == pytest.approx(0.14)
    assert _percentile(steps, 90) == pytest.approx(0.46)
    assert _percentile([0.7], 90) == pytest.approx(0.7)
    assert _percentile([], 10) is None


def test_table_shows_p10_and_p90_of_every_run() -> None:
    costs = defaultdict(lambda: 0.001, bandwidth_bytes_per_s=None)  # every simulator input: 1 ms
    run = {
        "name": "baseline-frozen.graph",
        "step_time_s": 0.030,
        "step_times_s": [0.010, 0.020, 0.030, 0.040, 0.050],
        "ratio_to_baseline": None,
        "pynative_over_graph": None,
        "bubble_fraction": 0.1,
        "overhead_fraction": 0.01,
        "dispatch_s": 0.0001,
        "compilations": 3,
        "compile_s": 1.0,
        "allocations_after_warmup": 0,
        "prediction": {
            "step_time_s": 0.03,
            "error": 0.0,
            "costs": costs,
        },
        "mpipe": None,
    }
    header, _, row = table({"runs": [run]}).splitlines()[:3]
    assert header.split()[:4] == ["run", "step", "ms", "p10"] and "p90" in header
    assert row.split()[1:4] == ["30.0", "14.0", "46.0"]
