"""``graph-exec bench qwen2vl --image-mix skewed --packing``, end to end at its smallest (structure,
not times): one measured step after one warm-up, two samples per micro-batch so rows can pack."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

COMMAND = [sys.executable, "-m", "graph_exec.cli"]
ENV = {**os.environ, "GLOG_v": "3"}


@pytest.mark.timeout(960)  # the bench is bounded at 900 s (pyproject's 300 s was hit under load)
def test_image_mix_bench_prints_every_run_ratios_and_simulation() -> None:
    pytest.importorskip("mindone")
    argv = [*COMMAND, "bench", "qwen2vl", "--image-mix", "skewed", "--tower-order", "arrival,balanced"]
    argv += ["--ranks", "2", "--micro", "4", "--batch", "8", "--steps", "1", "--warmup", "1", "--packing"]
    argv += ["--modes", "pynative"]  # the whole bench, structure only: pynative compiles nothing
    # a fixed tower and no pinning: under CI's load the calibration's times are noise
    argv += ["--vision-depth", "2", "--no-pin"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "1 heavy of 4 per step" in out
    names = ("baseline-frozen", "baseline-rebalanced", "mpipe-arrival", "mpipe-balanced")
    for name in (*names, "packed-tower", "packed-tokens"):
        row = re.search(rf"^  {name}\s+([\d.]+) +([\d.]+) +([\d.]+)$", out, re.M)
        assert row, f"no row for {name}:\n{out}"
        p10, p50, p90 = map(float, row.groups())
        assert 0 < p10 <= p50 <= p90
    assert re.search(
        r"ratios to balanced: baseline-frozen [\d.]+x, baseline-rebalanced [\d.]+x, mpipe-arrival", out
    )
    packed = {}
    for way in ("tower", "tokens"):
        row = re.search(
            rf"^  packed-{way}: real tokens/s ([\d.]+), padding fraction ([\d.]+), tower cost max/mean ([\d.]+)$",
            out,
            re.M,
        )
        assert row, f"no packed figures for {way}:\n{out}"
        packed[way] = tuple(map(float, row.groups()))
        assert packed[way][0] > 0 and 0 <= packed[way][1] < 1 and packed[way][2] >= 1.0
    assert packed["tower"][2] <= packed["tokens"][2]  # balanced rows spread the heavy images
    sims = re.search(r"simulated balanced speed-up over arrival: P=4 ([\d.]+)x, P=8 ([\d.]+)x", out)
    ceilings = re.search(
        r"ceiling of any placement \(arrival / towers free\): P=4 ([\d.]+)x, P=8 ([\d.]+)x", out
    )
    assert sims and ceilings, out
    for ratio, ceiling in zip(sims.groups(), ceilings.groups(), strict=True):
        assert float(ceiling) >= 1.0 and float(ratio) <= float(ceiling) + 1e-3
