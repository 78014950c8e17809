"""The split backward (``body="zb"``) against the 1F1B body at P = 2, measured, on a compute-bound chunk.

Each launch trains four configurations on two pinned ranks (as the harness pins them), step by
step in turn so that machine noise hits them alike: the 1F1B body and the zero-bubble body, each
without a preprocess (``ScheduleInterleaved1F1B``) and with MPipe (``ScheduleMPipeTranspose``, a
frozen tower of about two chunk forwards, ``run_ahead="full"``). Every chunk is ``--layers`` x
(``nn.Dense(width, width)`` + ``Tanh``) on ``--rows`` rows, float32, graph mode. A step's time is
the slower rank's ``run()``; the compute steps' own durations come from the runtime's timeline
(``sync_steps``: each step waits for its results), so ``F``, ``B`` (1F1B), ``I`` and ``W`` (zb)
of rank 0's chunk are reported as they ran inside the pipeline. ``--runs`` launches, each printing
its medians; the parent prints every run and the spread over runs, then the simulator's step
times for the measured costs and for device-like costs where ``I + W = B``.

Usage: ``python -m graph_exec.benchmarks.zero_bubble [--runs 3] [--micro 4] [--vpp 1]``
(run under the machine's lock: ``flock /tmp/ge-dist.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

from graph_exec.benchmarks.common import RESULT, argument_parser, launch_and_report

#: (name, schedule, body) of every measured configuration.
CONFIGS = (
    ("plain_1f1b", "plain", "1f1b"),
    ("plain_zb", "plain", "zb"),
    ("mpipe_1f1b", "mpipe", "1f1b"),
    ("mpipe_zb", "mpipe", "zb"),
)


def _parser():
    parser = argument_parser(__doc__, "zero_bubble")
    parser.add_argument("--runs", type=int, default=3, help="launches (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per configuration (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (default 2)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--vpp", type=int, default=1, help="chunks per rank (default 1)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--rows", type=int, default=256, help="rows per micro-batch (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="Dense+Tanh layers per chunk (default 4)")
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    return parser


# ----------------------------------------------------------------------------- worker


def _chunk(layers: int, width: int, prefix: str):
    from mindspore import nn

    cells = []
    for _ in range(layers):
        cells += [nn.Dense(width, width), nn.Tanh()]
    chunk = nn.SequentialCell(cells)
    chunk.update_parameters_name(prefix + ".")
    return chunk


def _worker(args) -> int:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, ops
    from mindspore.communication import get_group_size, get_rank, init

    from graph_exec.harness.worker import pin_cores

    pin_cores(2)
    import graph_exec as ge
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    rank, pp = get_rank(), get_group_size()
    num_stages = pp * args.vpp
    ms.set_seed(0)

    def loss_fn(output, labels):
        return ops.mean((output - labels) ** 2)

    schedules = {}
    for name, kind, body in CONFIGS:
        body = "interleaved" if body == "1f1b" and args.vpp > 1 else body
        stages = [
            ge.PipelineStage(_chunk(args.layers, args.width, f"{name}.s{s}"), s, num_stages)
            for s in range(rank, num_stages, pp)
        ]
        if kind == "plain":
            schedules[name] = ge.ScheduleInterleaved1F1B(
                stages, args.micro, loss_fn=loss_fn, body=body, timeout_s=300
            )
        else:
            tower = _chunk(2 * args.layers, args.width, f"{name}.tower")
            for param in tower.get_parameters():
                param.requires_grad = False
            schedules[name] = ge.ScheduleMPipeTranspose(
                stages, args.micro, tower, 1, loss_fn=loss_fn, body=body, timeout_s=300
            )
    rng = np.random.default_rng(0)
    size = args.micro * args.rows
    x = Tensor(rng.standard_normal((size, args.width)).astype(np.float32))
    labels = Tensor(rng.standard_normal((size, args.width)).astype(np.float32))
    steps: dict[str, list[float]] = defaultdict(list)
    durations: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step in range(args.warmup + args.steps):
        for name, sched in schedules.items():
            start = time.perf_counter()
            sched.run(x, labels=labels)
            elapsed = time.perf_counter() - start
            sched.zero_grad()
            if step < args.warmup:
                continue
            steps[name].append(elapsed)
            for event in sched.timeline:
                kind = event.step.split(".")[0].rstrip("0123456789")
                if kind in ("F", "B", "I", "W", "TFWD"):
                    durations[name][kind].append(event.end - event.start)
    report = {
        "rank": rank,
        "steps": dict(steps),
        "compute_ms": {
            name: {kind: 1e3 * statistics.median(values) for kind, values in kinds.items()}
            for name, kinds in durations.items()
        },
    }
    print(RESULT + json.dumps(report), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def _summarise(reports: list[dict]) -> dict:
    """One launch: per configuration the median step (the slower rank of each step, ms) and
    rank 0's compute-step medians."""
    by_rank = {r["rank"]: r for r in reports}
    result = {}
    for name, _, _ in CONFIGS:
        per_step = [max(values) for values in zip(*(r["steps"][name] for r in by_rank.values()), strict=True)]
        result[name] = {
            "step_ms": 1e3 * statistics.median(per_step),
            "rank0": by_rank[0]["compute_ms"][name],
            "rank1": by_rank[1]["compute_ms"][name],
        }
    return result


def _simulated(
    args, f: float, i: float, w: float, b: float, tower: float, f_zb: float | None = None
) -> dict[str, float]:
    """The simulator's step times (ms) for these costs, 1F1B body against zb, with and without
    MPipe; ``f_zb``: the forward of the zb body where it differs (the probed forward)."""
    from graph_exec.schedule import PlanConfig, build_plan
    from graph_exec.simulate import OpCosts, simulate

    body_1f1b = "1f1b" if args.vpp == 1 else "interleaved"
    out = {}
    for kind, preprocess in (("plain", "none"), ("mpipe", "frozen")):
        for body in (body_1f1b, "zb"):
            forward = f_zb if body == "zb" and f_zb is not None else f
            costs = OpCosts(
                forward=forward, backward=b, input_backward=i, weight_backward=w, preprocess_forward=tower
            )
            config = PlanConfig(pp=2, vpp=args.vpp, micro=args.micro, preprocess=preprocess, body=body)
            out[f"{kind}_{'zb' if body == 'zb' else '1f1b'}"] = simulate(build_plan(config), costs).step_time
    return out


def held_weight_work(plan) -> list[int]:
    """Per rank, the most micro-batches whose weight work is held at once (``I`` run, ``W`` not
    yet; on the last stage from its fused ``F``)."""
    from graph_exec.schedule import StepKind

    peaks = []
    for order in plan.orders:
        held = peak = 0
        for step in order:
            last = step.stage == plan.last_stage
            if (step.kind is StepKind.I and not last) or (step.kind is StepKind.F and last):
                held += 1
            elif step.kind is StepKind.W:
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _memory_line(args) -> str:
    """What the split holds between I and W (``docs/schedule.md``, "What is saved")."""
    from graph_exec.schedule import PlanConfig, build_plan

    peaks = held_weight_work(build_plan(PlanConfig(pp=2, vpp=args.vpp, micro=args.micro, body="zb")))
    saved = args.vpp * args.layers * 2 * args.rows * args.width * 4 / 2**20
    return (
        f"held from I to W per micro-batch: every Dense layer's input and output gradient, "
        f"{saved:.2f} MiB (rank's chunks, float32); at most {peaks} micro-batches held at once "
        f"(ranks 0, 1); plus one probe and one store per layer per input signature, {saved:.2f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.as_rank:
        return _worker(args)
    forwarded = [
        f"--{key}={getattr(args, key)}"
        for key in ("steps", "warmup", "micro", "vpp", "width", "rows", "layers")
    ]
    runs = []
    for run in range(args.runs):
        reports: list[dict] = []
        status = launch_and_report(
            __file__,
            ["--as-rank", *forwarded],
            nproc=2,
            timeout_s=900,
            heading=f"run {run + 1}/{args.runs}",
            sink=lambda line, into=reports: into.append(json.loads(line)),
        )
        if status:
            return status
        summary = _summarise(reports)
        runs.append(summary)
        print(json.dumps(summary, indent=None))
    print(f"\nP=2 V={args.vpp} M={args.micro}, {args.layers}x Dense({args.width})+Tanh on {args.rows} rows")
    print("median step (ms) per run, and zb's speed-up over the 1F1B body:")
    for kind in ("plain", "mpipe"):
        base = [r[f"{kind}_1f1b"]["step_ms"] for r in runs]
        zb = [r[f"{kind}_zb"]["step_ms"] for r in runs]
        ratio = [b / z for b, z in zip(base, zb, strict=True)]
        print(
            f"  {kind:6s} 1f1b {', '.join(f'{v:.1f}' for v in base)}  zb {', '.join(f'{v:.1f}' for v in zb)}"
            f"  speed-up {', '.join(f'{v:.3f}' for v in ratio)} (min {min(ratio):.3f}, max {max(ratio):.3f})"
        )

    def cost(config: str, kind: str) -> list[float]:
        return [r[config]["rank0"][kind] for r in runs]

    f, b = cost("plain_1f1b", "F"), cost("plain_1f1b", "B")
    f_zb, i, w = cost("plain_zb", "F"), cost("plain_zb", "I"), cost("plain_zb", "W")
    tower = cost("mpipe_1f1b", "TFWD") if "TFWD" in runs[0]["mpipe_1f1b"]["rank0"] else [0.0]
    print("rank 0 chunk compute, ms per run (median step of each kind):")
    for label, values in (("F", f), ("F zb", f_zb), ("B", b), ("I", i), ("W", w), ("TFWD", tower)):
        print(f"  {label:4s} {', '.join(f'{v:.2f}' for v in values)}")
    fm, fzm, bm, im, wm, tm = (statistics.median(v) for v in (f, f_zb, b, i, w, tower))
    print(f"  I + W - B = {im + wm - bm:.2f} ms; F zb - F = {fzm - fm:.2f} ms (the probed forward)")
    print(_memory_line(args))
    measured = _simulated(args, fm, im, wm, bm, tm, f_zb=fzm)
    device_like = _simulated(args, fm, bm / 2, bm / 2, bm, tm)
    for label, sim in (("measured costs", measured), ("device-like I = W = B/2", device_like)):
        print(
            f"simulated ({label}): "
            + ", ".join(f"{k} {v:.1f}" for k, v in sim.items())
            + f"; zb speed-up plain {sim['plain_1f1b'] / sim['plain_zb']:.3f}, "
            f"mpipe {sim['mpipe_1f1b'] / sim['mpipe_zb']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
