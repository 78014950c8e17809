"""What the CPU fast paths buy: the same ``graph-exec bench`` job with them on and off, alternated.

    python -m graph_exec.benchmarks.fast_paths embed_lm --variants trainable-full --repeats 3
    python -m graph_exec.benchmarks.fast_paths vl_tower --size small --variants frozen-full

``GRAPH_EXEC_CPU_FAST_PATHS=0`` makes a CPU process take the path a GPU or Ascend rank takes
(:mod:`graph_exec.device`). The switch is read once per process, so the two paths cannot share
a launch: this script runs the bench job ``--repeats`` times on each path, alternating (fast,
device, fast, device, ...) so that machine noise hits both alike, and prints for every run of
the job (each variant and its fair baseline, in each mode) the step time p10/p50/p90 of every
launch, then the ratio of the device path's median step time to the fast path's, per repeat.
Options after the example go to ``graph-exec bench`` unchanged (``--json`` is taken by this
script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from graph_exec.benchmarks.common import p10_p50_p90
from graph_exec.device import FAST_PATHS_ENV

PATHS = {"fast": "1", "device": "0"}


def bench(args: list[str], fast_paths: str, out: Path) -> dict:
    """One ``graph-exec bench`` launch with the switch at ``fast_paths``; its JSON report."""
    env = {**os.environ, FAST_PATHS_ENV: fast_paths}
    command = [sys.executable, "-m", "graph_exec.cli", "bench", *args, "--json", str(out)]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text(encoding="utf-8"))


def main(argv: list[str]) -> int:
    repeats = 3
    if "--repeats" in argv:
        at = argv.index("--repeats")
        repeats = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    if not argv or argv[0].startswith("-") or "--json" in argv:
        print(__doc__, file=sys.stderr)
        return 2
    steps: dict[tuple[str, str], list[list[float]]] = defaultdict(list)  # (run, path) -> per repeat
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for path, value in PATHS.items():
                report = bench(argv, value, Path(tmp) / f"{path}{repeat}.json")
                for run in report["runs"]:
                    steps[(run["name"], path)].append(run["step_times_s"])
                print(f"repeat {repeat + 1}/{repeats}, {path} path: done", file=sys.stderr, flush=True)
    names = sorted({name for name, _ in steps})
    print(f"graph-exec bench {' '.join(argv)}: step time p10/p50/p90 in ms per launch, {repeats} repeats")
    for name in names:
        for path in PATHS:
            cells = ["/".join(f"{t * 1e3:.1f}" for t in p10_p50_p90(times)) for times in steps[(name, path)]]
            print(f"  {name:<34} {path:<6} {'   '.join(cells)}")
        ratios = [
            p10_p50_p90(device)[1] / p10_p50_p90(fast)[1]
            for fast, device in zip(steps[(name, "fast")], steps[(name, "device")], strict=True)
        ]
        print(f"  {name:<34} device/fast (p50): {'  '.join(f'{r:.2f}x' for r in ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
