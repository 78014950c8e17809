"""``graph-exec tune vl_tower --ranks 2 --verify`` end to end, smallest settings: calibration in
one process and three short launches, the cost file, the table of the best plans, and the verify
launch of the best three (and the best of a schedule not among them). Structure only: no time is asserted (the machine is shared)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from graph_exec.report.job import JobSpec
from graph_exec.tune import ModelCosts

COMMAND = [sys.executable, "-m", "graph_exec.cli"]
ENV = {**os.environ, "GLOG_v": "3"}
ROW = re.compile(
    r"^ ?\d+\. (baseline|mpipe) split=even V=1 M=2 .*recompute=(on|off) +step [0-9.e-]+  peak MiB/rank \S+ \S+$"
)
VERIFIED = re.compile(
    r"^ \d\. (baseline|mpipe) .+ predicted +[0-9.]+  measured +[0-9.]+  measured/predicted [0-9.]+"
    r"  compute [0-9.]+$"
)
VERDICT = re.compile(
    r"^MPipe (not )?faster than the best baseline \(baseline split=even: [0-9.]+ against [0-9.]+ ms\); "
    r"the search chose (mpipe|baseline): (agrees|DISAGREES)( \(a tie: [0-9.]+x apart, within 1\.03x\))?$"
)


def test_tune_verify_prints_the_plans_and_measures_the_best_three_and_each_schedule(tmp_path: Path) -> None:
    costs_file, logs = tmp_path / "costs.json", tmp_path / "logs"
    argv = [*COMMAND, "tune", "vl_tower", "--ranks", "2", "--batch", "4", "--micro", "2", "--verify"]
    argv += ["--steps", "2", "--warmup", "1", "--save-costs", str(costs_file), "--log-dir", str(logs)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()

    costs = ModelCosts.load(costs_file)  # a valid cost file, measured in the pipeline
    assert costs.preprocess == "frozen" and 0 <= costs.fixed_share <= 1
    # transfers fitted from the calibration launch (on an idle loopback they may cost nothing
    # measurable: latency 0, bandwidth unbounded)
    assert costs.latency >= 0 and costs.bandwidth > 0, costs
    for launch in ("calibration_V2_M2", "calibration_V1_M2"):  # V = 1 beside V = 2: calls apart from layers
        assert sorted(p.name for p in (logs / launch).glob("calibration*.json")) == [
            "calibration.graph.rank0.json",
            "calibration.graph.rank1.json",
        ], launch
    assert costs.hidden_bytes > 0 and costs.layer_param_bytes > 0

    header = next(
        k for k, line in enumerate(out) if re.match(r"^\d+ plans fit any memory; the best \d+", line)
    )
    shown = int(re.match(r"^\d+ plans fit any memory; the best (\d+)", out[header]).group(1))
    rows = out[header + 1 : header + 1 + shown]
    assert shown >= 3 and all(ROW.match(row) for row in rows), rows

    start = out.index("verified (ms):")
    end = next(k for k in range(start, len(out)) if out[k].startswith("fastest measured: "))
    verified = out[start + 1 : end]  # the best three, then the best of a family not among them
    assert 3 <= len(verified) <= 4 and all(VERIFIED.match(line) for line in verified), verified
    schedules = {line.split(". ", 1)[1].split()[0] for line in verified}
    assert schedules == {"baseline", "mpipe"}, verified
    for row, line in zip(rows[:3], verified[:3], strict=True):  # the same three, in the same order
        assert (
            row.split("step")[0].split(". ", 1)[1].strip()
            == line.split("predicted")[0].split(". ", 1)[1].strip()
        )
    assert re.match(r"^fastest measured: #\d ", out[end])
    assert re.match(r"^chosen #1 is [0-9.]+x the fastest verified: (NOT )?within 1\.03x$", out[end + 1])
    assert VERDICT.match(out[end + 2]), out[end + 2]

    # one verify launch (every candidate has M = 2), which ran the candidates as separate runs
    job = JobSpec.read(logs / "verify_V1_M2" / "job.json")
    assert [r.name for r in job.runs] == [f"candidate{k}.graph" for k in range(1, len(verified) + 1)]
    records = sorted((logs / "verify_V1_M2").glob("**/*candidate*"))
    assert records, "the verify launch wrote no records"
    for line in verified:
        measured = float(re.search(r"measured +([0-9.]+)  ", line).group(1))
        assert measured > 0 and math.isfinite(measured)
    assert json.loads(costs_file.read_text())["layers"] == costs.layers

    # tune_replay derives the same cost file from the same launch logs: the same predictions
    from graph_exec.benchmarks.tune_replay import replay

    (tmp_path / "output.txt").write_text(proc.stdout, encoding="utf-8")
    repriced = replay(tmp_path)
    assert [p.plan for p in repriced] == [
        line.split(". ", 1)[1].split(" predicted")[0].strip() for line in verified
    ]
    for p in repriced:
        assert abs(p.now - p.printed) <= 0.006, p  # printed to 0.01 ms
