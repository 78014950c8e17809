"""The fault table of docs/restarts.md: what each fault costs a ``graph-exec run --max-restarts``
job, and whether the job still ends bit-identical.

    python -m graph_exec.benchmarks.fault_table                  # every fault, 3 times each
    python -m graph_exec.benchmarks.fault_table --repeats 1 --faults stop-0,stop-1

Run from a checkout: the faults come from the multi-rank tests' worker,
``tests/multirank/workers/restart_harness.py`` (the harness plus a hook that kills, stops or
poisons one rank at a chosen step and prints the wall-clock time it did). Every job is
``graph-exec run embed_lm --steps 40 --checkpoint-dir D --save-every 2 --max-restarts 1``
with ``--peer-timeout 20``; the fault strikes right before step 12 (step 11 during a save), so
checkpoint 10 is the last complete one. The reference is the same job without a fault.

Per fault and repeat, from the job's output (each line stamped when it arrives) and logs:

- **detect**: the fault to the launcher's record of it (its "relaunching" line: the failure
  classified and every process of the attempt gone; for a job that is not relaunched, its end);
- **restart**: the fault to the first step the relaunched job finished (msrun, set-up, the
  checkpoint load and the first step's compilation included);
- **record**: what the attempt record says the attempt died of (its cause, in words);
- **bit-identical**: whether the job's final loss equals the reference's bit for bit.

"corrupt latest checkpoint": a fault-free job of 20 steps (checkpoints 18 and 20 kept), its
step-20 rank 1 file damaged, then the job resumed to 40 (``--resume``): the fault is the launch. "NaN step": every gradient of
rank 1's step 12 is NaN.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from graph_exec.report.job import PROGRESS

HARNESS = Path(__file__).resolve().parents[2] / "tests" / "multirank" / "workers" / "restart_harness.py"
STEPS, SAVE_EVERY, FAULT_STEP = 40, 2, 11
FLAGS = [
    "--ranks",
    "2",
    "--save-every",
    str(SAVE_EVERY),
    "--no-pin",
    "--timeout",
    "120",
    "--peer-timeout",
    "20",
]

#: name -> (words, the test hook's plan: ATTEMPT:RANK:STEP[:how]; None: not a hook's fault)
FAULTS: dict[str, tuple[str, str | None]] = {
    "kill-0": ("kill of rank 0", f"0:0:{FAULT_STEP}"),
    "kill-1": ("kill of rank 1", f"0:1:{FAULT_STEP}"),
    "stop-0": ("SIGSTOP of rank 0", f"0:0:{FAULT_STEP}:stop"),
    "stop-1": ("SIGSTOP of rank 1", f"0:1:{FAULT_STEP}:stop"),
    "save": ("kill of rank 1 during a save", f"0:1:{FAULT_STEP}:save"),
    "corrupt": ("corrupt latest checkpoint", None),
    "nan": ("NaN step (rank 1)", f"0:1:{FAULT_STEP}:nan"),
}

_STEP = re.compile(r"^step +\d+/\d+ ")
_FAULT_AT = re.compile(r"^TEST (?:KILL|STOP|NAN): .* at ([\d.]+)$", re.M)
_RECORD = re.compile(r"attempt 0: (.*)")

#: Run ``graph-exec`` with the harness swapped for the test worker (the hook reads its plan).
_CHILD = (
    "import sys; from pathlib import Path; from graph_exec.cli import jobs, main; "
    "jobs.WORKER = Path(sys.argv[1]); sys.exit(main(sys.argv[2:]))"
)


@dataclass
class Outcome:
    detect: float | None
    restart: float | None
    record: str
    final_loss: float | None


def final_loss(job_dir: Path) -> float | None:
    """The loss of the last step the last attempt's last stage (rank 1) reported."""
    log = job_dir / "logs" / "worker_1.log"
    lines = [x for x in log.read_text().splitlines() if x.startswith(PROGRESS)] if log.is_file() else []
    losses = [json.loads(x[len(PROGRESS) :]).get("loss") for x in lines]
    losses = [x for x in losses if x is not None]
    return losses[-1] if losses else None


def run_job(root: Path, argv: list[str], plan: str | None) -> tuple[list[tuple[float, str]], int, float]:
    """``graph-exec run embed_lm argv`` with ``plan`` for the hook: its stamped lines, exit
    code and start (wall clock)."""
    env = {**os.environ, "GLOG_v": "3"}
    if plan is not None:
        env["GRAPH_EXEC_TEST_KILL"] = plan
    command = [sys.executable, "-c", _CHILD, str(HARNESS), "run", "embed_lm", *FLAGS, *argv]
    command += ["--checkpoint-dir", str(root / "ckpt"), "--log-dir", str(root / "job")]
    began = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout or ()]
    return lines, proc.wait(), began


def measure(fault: str, root: Path, reference: Path) -> Outcome:
    """One job with ``fault``."""
    _, plan = FAULTS[fault]
    argv = ["--steps", str(STEPS), "--max-restarts", "1"]
    if fault == "corrupt":  # the first 20 steps' checkpoints (18 and 20 kept), step 20's damaged
        shutil.copytree(reference.with_name("first-20") / "ckpt", root / "ckpt")
        rank_file = root / "ckpt" / "step_20" / "rank_1.ckpt"
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(data))
        argv.append("--resume")
    lines, code, began = run_job(root, argv, plan)
    text = "\n".join(line for _, line in lines)
    if fault == "corrupt":
        fault_at = began
    else:
        logs = "".join(p.read_text() for p in (root / "job" / "logs").glob("**/worker_*.log"))
        found = _FAULT_AT.search(logs)
        if found is None:
            raise RuntimeError(f"{fault}: the hook never struck (exit {code}):\n{text}")
        fault_at = float(found.group(1))
    relaunch = next((t for t, line in lines if "relaunching" in line), None)
    end = lines[-1][0] if lines else time.time()
    record = next((m.group(1) for _, line in lines if (m := _RECORD.search(line))), None)
    if record is None:
        record = "finished, nothing recorded" if code == 0 else f"exit {code}, no record"
    first_step = next(
        (t for t, line in lines if relaunch is not None and t > relaunch and _STEP.match(line)), None
    )
    failed = code != 0 or relaunch is not None
    return Outcome(
        detect=(relaunch or end) - fault_at if failed else None,
        restart=None if first_step is None else first_step - fault_at,
        record=record,
        final_loss=final_loss(root / "job") if code == 0 else None,
    )


def short(record: str) -> str:
    """The cause words of an attempt's record line (without its step, start and cost)."""
    words = record.split("; ")[0]
    words = re.sub(r" \((?:graph_exec|rank).*\)(?= in step| ?$)", "", words)
    return words if len(words) <= 70 else words[:67] + "..."


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fault_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    args = parser.parse_args(argv)
    chosen = args.faults.split(",")
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown or args.repeats < 1:
        parser.error(
            f"unknown faults {unknown}; choose from {','.join(FAULTS)}" if unknown else "--repeats >= 1"
        )
    if not HARNESS.is_file():
        parser.error(f"{HARNESS} not found: run from a checkout of graph_exec")
    with tempfile.TemporaryDirectory(prefix="fault-table-") as tmp:
        reference = Path(tmp) / "reference"
        lines, code, _ = run_job(reference, ["--steps", str(STEPS)], None)
        if code != 0:
            raise RuntimeError("the reference job failed:\n" + "\n".join(line for _, line in lines))
        want = final_loss(reference / "job")
        if "corrupt" in chosen:
            lines, code, _ = run_job(Path(tmp) / "first-20", ["--steps", "20"], None)
            if code != 0:
                raise RuntimeError("the 20-step job failed:\n" + "\n".join(line for _, line in lines))
        results: dict[str, list[Outcome]] = {}
        for fault in chosen:
            for repeat in range(args.repeats):
                try:
                    outcome = measure(fault, Path(tmp) / f"{fault}-{repeat}", reference)
                except (RuntimeError, OSError) as err:  # one broken measurement must not lose the others
                    outcome = Outcome(None, None, f"not measured: {str(err).splitlines()[0]}", None)
                results.setdefault(fault, []).append(outcome)
                print(f"fault_table: {fault} #{repeat + 1}: {outcome}", file=sys.stderr, flush=True)
    print(
        f"embed_lm tiny, 2 ranks, {STEPS} steps saving every {SAVE_EVERY}, --max-restarts 1 --peer-timeout 20; "
        f"fault right before step {FAULT_STEP + 1}; {args.repeats} run(s) each; reference final loss {want!r}"
    )

    def seconds(values: list[float | None]) -> str:
        return " ".join("    -" if v is None else f"{v:5.1f}" for v in values)

    print("| fault | detect (s) | restart (s) | record names | final loss bit-identical |")
    print("|---|---|---|---|---|")
    for fault, outcomes in results.items():
        records = sorted({short(o.record) for o in outcomes})
        same = ["yes" if o.final_loss is not None and o.final_loss == want else "no" for o in outcomes]
        print(
            f"| {FAULTS[fault][0]} | {seconds([o.detect for o in outcomes])} | "
            f"{seconds([o.restart for o in outcomes])} | {' / '.join(records)} | {' '.join(same)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
