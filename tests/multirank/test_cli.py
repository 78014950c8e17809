"""``graph-exec run`` and ``graph-exec bench`` end to end: real msrun launches, smallest settings.

Each test runs the command the way a user does (a subprocess with a time limit) and checks
what it printed and wrote: progress while training runs, the summary, the trace, the bench
JSON against its schema, and a clean failure report.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from graph_exec.report.bench_schema import check

COMMAND = [sys.executable, "-m", "graph_exec.cli"]
ENV = {**os.environ, "GLOG_v": "3"}


def lines_within(proc: subprocess.Popen, seconds: float) -> Iterator[str]:
    """``proc``'s output lines as they come; fails the test if the output has not ended within
    ``seconds`` (a reader thread, so a silent, hung command cannot block the test)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + seconds
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"no end of output within {seconds} s") from None
        if line is None:
            return
        yield line


def reference_first_step_loss(example: str, job: dict, trainable: bool) -> float:
    """The mean micro-batch loss of step 0 computed without any pipeline: the whole model (the
    preprocess, then every chunk in order) on the bench's own first batch."""
    from graph_exec.examples import load
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    model = load(example).build(
        job["ranks"] * job["vpp"], trainable_preprocess=trainable, seed=0, size=job["size"]
    )
    inputs, labels = model.batch(0, job["batch"])
    per = job["batch"] // job["micro"]
    losses = []
    for m in range(job["micro"]):
        out = tuple(t[m * per : (m + 1) * per] for t in inputs)
        chunks = ([model.preprocess] if model.preprocess is not None else []) + list(model.stages)
        for chunk in chunks:
            out = chunk(*out)
            out = out if isinstance(out, tuple) else (out,)
        losses.append(float(model.loss_fn(*out, labels[m * per : (m + 1) * per]).asnumpy()))
    return float(np.mean(losses))


def test_run_streams_progress_then_summarises_and_traces(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    argv = [*COMMAND, "run", "embed_lm", "--ranks", "2", "--steps", "3", "--backward", "owner"]
    argv += ["--trace", str(trace), "--log-dir", str(tmp_path / "job")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines: list[str] = []
    running_at_first_step = None
    try:
        for line in lines_within(proc, 240):
            lines.append(line)
            if line.startswith("step ") and running_at_first_step is None:
                running_at_first_step = proc.poll() is None
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert code == 0, text
    assert running_at_first_step, "the first progress line arrived only after the command ended"
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"], text
    assert all(re.search(r" loss [\d.]+  last stage's run\(\) +[\d.]+ ms", s) for s in steps), text
    assert re.search(r" compiled \d+ graph\(s\) in [\d.]+ s$", steps[0]), text  # the first step compiles
    assert "backward=owner" in lines[0]
    for expected in (
        "loss: ",
        "median step time: ",
        "compilations: ",
        "receive-buffer allocations after warm-up: 0",
    ):
        assert any(line.startswith(expected) for line in lines), (expected, text)
    doc = json.loads(trace.read_text())
    tracks = {e["tid"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {0, 1}
    tokens = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"F0.0", "TFWD1", "OUTsend1", "GRADreduce", "step 2"} <= tokens
    assert sorted(p.name for p in (tmp_path / "job").glob("run.rank*.json")) == [
        "run.rank0.json",
        "run.rank1.json",
    ]


def test_run_baseline_is_the_fair_baseline(tmp_path: Path) -> None:
    """``run --baseline``: the preprocess on rank 0 next to F 0.m / B 0.m, nothing broadcast or shipped."""
    trace = tmp_path / "trace.json"
    argv = [*COMMAND, "run", "embed_lm", "--ranks", "2", "--steps", "2", "--baseline", "--trace", str(trace)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fair baseline" in proc.stdout.splitlines()[0]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    by_rank = {
        tid: [e["name"] for e in events if e["tid"] == tid and e.get("cat") != "step"] for tid in (0, 1)
    }
    assert {"TFWD0", "TBWD0", "F0.0", "B0.0"} <= set(by_rank[0])
    assert not any(name.startswith(("BCAST", "OUT", "TFWD", "TBWD")) for name in by_rank[1])
    assert not any(name.startswith(("BCAST", "OUT")) for name in by_rank[0])


@pytest.mark.timeout(420)  # the bench is bounded at 300 s, then the reference is computed
def test_bench_writes_a_schema_valid_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [*COMMAND, "bench", "vl_tower", "--variants", "frozen-full", "--steps", "2", "--warmup", "1"]
    argv += ["--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert check(doc) == []
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {
        "baseline-frozen.graph",
        "frozen-full.graph",
        "baseline-frozen.pynative",
        "frozen-full.pynative",
    }
    for run in runs.values():
        assert run["allocations_after_warmup"] == 0
        assert len(run["step_times_s"]) == 2 and len(run["losses"]) == 3
        assert 0 <= run["bubble_fraction"] < 1 and run["prediction"]["step_time_s"] > 0
    # Step 0 against a non-pipelined reference; later steps (after Adam updates from the same
    # gradients) agree between MPipe and the baseline within float32 noise (rtol 1e-4).
    first = reference_first_step_loss("vl_tower", doc["job"], trainable=False)
    for run in runs.values():
        np.testing.assert_allclose(run["losses"][0], first, rtol=1e-4, atol=1e-5, err_msg=run["name"])
    for mode in ("graph", "pynative"):
        np.testing.assert_allclose(
            runs[f"frozen-full.{mode}"]["losses"],
            runs[f"baseline-frozen.{mode}"]["losses"],
            rtol=1e-4,
            atol=1e-5,
        )
    mpipe = runs["frozen-full.graph"]
    assert mpipe["baseline_run"] == "baseline-frozen.graph" and mpipe["pynative_over_graph"] > 0
    assert mpipe["mpipe"]["nt"] == 2 and mpipe["mpipe"]["pf_s"] > 0
    assert mpipe["mpipe"]["simulated_saving_s"] is not None
    assert runs["baseline-frozen.graph"]["preprocess"] == "frozen"  # the fair baseline runs the tower
    assert "saving vs fair baseline (ms)" in proc.stdout
    assert runs["frozen-full.pynative"]["compilations"] == 0 < mpipe["compilations"]
    for name in runs:
        assert name in proc.stdout


def _job_processes(marker: str) -> list[int]:
    """Processes whose command line mentions ``marker`` (a job's unique directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_failed_run_reports_keeps_its_logs_and_leaves_no_process() -> None:
    argv = [*COMMAND, "run", "vl_tower", "--steps", "2", "--timeout", "3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 1
    assert "msrun timed out after" in proc.stderr
    kept = Path(proc.stderr.rsplit("logs kept in ", 1)[1].strip())
    try:
        assert (kept / "job.json").exists() and (kept / "logs").is_dir()
        assert _job_processes(str(kept)) == []  # the workers msrun started are gone too
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_ctrl_c_stops_every_process_of_the_job(tmp_path: Path) -> None:
    argv = [*COMMAND, "run", "embed_lm", "--steps", "50", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in lines_within(proc, 240):
            if line.startswith("step "):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted, the job was stopped" in err
    assert _job_processes(str(tmp_path)) == []
