"""What one dead rank costs a ``graph-exec run --max-restarts`` job, piece by piece.

    python -m graph_exec.benchmarks.restart_cost                     # embed_lm, 12 steps, save every 3
    python -m graph_exec.benchmarks.restart_cost --kill-after 7 --repeats 3

Runs ``graph-exec run embed_lm --checkpoint-dir … --save-every S --max-restarts 1`` as a user
does, reads its output line by line (each line stamped when it arrives) and sends SIGKILL to
rank 1's worker right after the progress line of step ``--kill-after``. From the stamps:

- **detection**: the kill to the launcher's "relaunching" line (the failure reported and every
  process of the attempt gone);
- **relaunch**: that line to "ranks connected" of the new attempt (msrun, communication set-up);
- **reload + recompilation**: "ranks connected" to the end of the first resumed step (the
  model built, the checkpoint loaded — its own time is printed too — and the first step's
  graphs compiled and run), minus one median step;
- **steps redone**: the steps finished after the checkpoint the relaunch resumed from, at the
  median step time of the resumed attempt.

The sum is the wall time the failure cost beyond the uninterrupted job (the killed step's own
partial work included in detection).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STEP = re.compile(r"^step +(\d+)/(\d+) .*last stage's run\(\) +([\d.]+) ms")
_LOADED = re.compile(r"^resumed from checkpoint step (\d+) \(loaded in (\d+) ms\)")
_REDONE = re.compile(r"(\d+) steps? to redo")


def worker_pid(job_dir: Path, rank: int) -> int | None:
    """The live msrun worker of ``rank`` whose command line names ``job_dir``."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(job_dir) not in cmdline.read_bytes().decode(errors="replace"):
                continue
            raw = (cmdline.parent / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw if "=" in item)
        if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank):
            return int(cmdline.parent.name)
    return None


def measure(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One restarted job; its costs in seconds (and the counts)."""
    job_dir = root / "job"
    command = [sys.executable, "-m", "graph_exec.cli", "run", "embed_lm", "--steps", str(args.steps)]
    command += ["--save-every", str(args.save_every), "--checkpoint-dir", str(root / "ckpt")]
    command += ["--max-restarts", "1", "--log-dir", str(job_dir), "--timeout", str(args.timeout)]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GLOG_v": "3"},
    )
    stamps: dict[str, float] = {}
    steps_after: list[float] = []
    lines = []
    loaded_ms = redone = 0.0
    for line in proc.stdout or ():
        now = time.monotonic()
        lines.append(line.rstrip("\n"))
        step = _STEP.match(line)
        if step and "kill" not in stamps and int(step.group(1)) == args.kill_after:
            victim = worker_pid(job_dir, 1)
            if victim is None:
                raise RuntimeError("rank 1's worker was not found")
            stamps["kill"] = time.monotonic()
            os.kill(victim, 9)
        elif step and "relaunch" in stamps:
            stamps.setdefault("first_step", now)
            steps_after.append(float(step.group(3)) / 1e3)
        elif "relaunching" in line and "kill" in stamps:
            stamps["relaunch"] = now
            found = _REDONE.search(line)
            redone = float(found.group(1)) if found else float("nan")
        elif line.startswith("ranks connected") and "relaunch" in stamps:
            stamps.setdefault("connected", now)
        elif _LOADED.match(line):
            loaded_ms = float(_LOADED.match(line).group(2))
    code = proc.wait()
    missing = {"kill", "relaunch", "connected", "first_step"} - set(stamps)
    if code != 0 or missing:
        raise RuntimeError(f"the job failed (exit {code}, missing {sorted(missing)}):\n" + "\n".join(lines))
    step_s = statistics.median(steps_after[1:] or steps_after)
    return {
        "detection": stamps["relaunch"] - stamps["kill"],
        "relaunch": stamps["connected"] - stamps["relaunch"],
        "reload_recompile": stamps["first_step"] - stamps["connected"] - step_s,
        "load": loaded_ms / 1e3,
        "redone_steps": redone,
        "redone": redone * step_s,
        "step": step_s,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="restart_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=7, help="kill rank 1 after this step (1-based)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        parser.error(f"--kill-after {args.kill_after} must be in [1, {args.steps - 1}]")
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="restart-cost-") as root:
            runs.append(measure(args, Path(root)))
    print(
        f"embed_lm tiny, 2 ranks, graph mode, {args.steps} steps saving every {args.save_every}; SIGKILL of "
        f"rank 1 after step {args.kill_after}; {args.repeats} run(s), load {os.getloadavg()[0]:.1f}"
    )
    rows = [
        ("detection (kill -> relaunch line, every process gone)", "detection"),
        ("relaunch (msrun, communication set-up)", "relaunch"),
        ("reload + recompilation (build, load, first step's graphs)", "reload_recompile"),
        ("  of which the checkpoint load", "load"),
        ("steps redone", "redone"),
    ]
    for words, key in rows:
        values = " ".join(f"{run[key]:7.2f}" for run in runs)
        counts = ", ".join(f"{r['redone_steps']:.0f} x {r['step'] * 1e3:.0f} ms" for r in runs)
        extra = f"  (steps x median step: {counts})" if key == "redone" else ""
        print(f"{words:<60} {values} s{extra}")
    total = [r["detection"] + r["relaunch"] + r["reload_recompile"] + r["redone"] for r in runs]
    print(f"{'total lost per failure':<60} {' '.join(f'{t:7.2f}' for t in total)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
