"""The first thing to run on a machine with accelerators: 2 ranks, both schedules, the numbers
checked against a single-process reference, and step times.

    python -m graph_exec.benchmarks.device_smoke --device GPU
    python -m graph_exec.benchmarks.device_smoke --device Ascend --modes graph --steps 10
    GRAPH_EXEC_CPU_FAST_PATHS=0 python -m graph_exec.benchmarks.device_smoke   # the device path on CPU

It launches itself under msrun on 2 local ranks (rank ``r`` uses device ``r``). Each rank builds
the ``embed_lm`` tiny example with the same seed, keeps its own chunks and, for MPipe Transpose
(trainable preprocess, central and owner backward) and the fair baseline, in each mode: runs one
step and compares the losses (last rank) and every gradient it holds with the gradients of the
whole model computed in one process on the same device, non-pipelined (``mindspore.value_and_grad``
of the mean loss over the micro-batches); then times ``--steps`` further steps (Adam updates
in between). A rank prints one line per check and per timing; the launcher prints them and exits 1
if any check failed or the job did not finish. Tolerances: atol 1e-5 / rtol 1e-4 on CPU (the same
kernels on the same data), atol 1e-4 / rtol 1e-3 on devices, whose kernels may round differently
for the micro-batch shapes than for the whole batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from graph_exec.benchmarks.common import RESULT, argument_parser, launch_and_report, p10_p50_p90

#: (name, schedule, backward) of each case, run in each mode.
CASES = (
    ("mpipe-central", "mpipe", "central"),
    ("mpipe-owner", "mpipe", "owner"),
    ("baseline", "baseline", ""),
)
MICRO, BATCH = 4, 8


def parse_args(argv: list[str] | None = None) -> Any:
    from graph_exec.device import TARGETS

    parser = argument_parser(__doc__, "device_smoke")
    parser.add_argument(
        "--device", choices=TARGETS, default="CPU", help="MindSpore device target (default CPU)"
    )
    parser.add_argument(
        "--modes", default="graph,pynative", help="executor modes, comma-separated (default graph,pynative)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case after the checked one")
    parser.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit of the job, seconds")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(mode not in ("graph", "pynative") for mode in modes):
        parser.error(f"--modes must list graph and/or pynative, got {args.modes!r}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def report(rank: int, **fields: Any) -> None:
    print(RESULT + json.dumps({"rank": rank, **fields}), flush=True)


def reference(model: Any, inputs: tuple[Any, ...], labels: Any) -> tuple[list[float], dict[str, Any]]:
    """Per-micro-batch losses and the gradient of their mean, of the whole model in this process."""
    import mindspore as ms

    params = [p for cell in (model.preprocess, *model.stages) for p in cell.trainable_params()]
    rows = BATCH // MICRO

    def micro_loss(m: int) -> Any:
        x: Any = model.preprocess(*(t[m * rows : (m + 1) * rows] for t in inputs))
        for chunk in model.stages:
            x = chunk(*(x if isinstance(x, tuple) else (x,)))
        return model.loss_fn(x, labels[m * rows : (m + 1) * rows])

    losses = [float(micro_loss(m).asnumpy()) for m in range(MICRO)]

    def mean_loss() -> Any:
        return sum(micro_loss(m) for m in range(MICRO)) / MICRO

    _, grads = ms.value_and_grad(mean_loss, None, params)()
    return losses, {p.name: g.asnumpy() for p, g in zip(params, grads, strict=True)}


def run_case(rank: int, pp: int, device: str, mode: str, case: tuple[str, str, str], steps: int) -> bool:
    """One case on this rank: the checked step, then the timed ones; returns whether it passed."""
    import numpy as np

    name, schedule, backward = case
    model, sched = _build(rank, pp, mode, schedule, backward)
    inputs, labels = model.batch(0, BATCH)
    ref_losses, ref_grads = reference(model, inputs, labels)
    atol, rtol = (1e-5, 1e-4) if device == "CPU" else (1e-4, 1e-3)
    losses = sched.run(*inputs, labels=labels)
    where = f"{name} {mode}"
    ok = True
    if losses is not None:
        got = [float(x.asnumpy()) for x in losses]
        passed = bool(np.allclose(got, ref_losses, atol=atol, rtol=rtol))
        report(
            rank,
            case=where,
            check="losses",
            ok=passed,
            error=float(np.max(np.abs(np.subtract(got, ref_losses)))),
        )
        ok &= passed
    errors = {
        key: float(np.max(np.abs(grad.asnumpy() - ref_grads[key])))
        for key, grad in sched.grads().items()
        if grad.size
    }
    passed = all(
        np.allclose(grad.asnumpy(), ref_grads[key], atol=atol, rtol=rtol)
        for key, grad in sched.grads().items()
    )
    report(
        rank,
        case=where,
        check="gradients",
        ok=passed,
        tensors=len(errors),
        error=max(errors.values(), default=0.0),
    )
    ok &= passed
    seconds = _timed_steps(model, sched, steps)
    p10, p50, p90 = p10_p50_p90(seconds[1:] or seconds)
    report(
        rank, case=where, timing={"p10_ms": p10 * 1e3, "p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3}, steps=steps
    )
    return ok


def _build(rank: int, pp: int, mode: str, schedule: str, backward: str) -> tuple[Any, Any]:
    """The tiny ``embed_lm`` (seed 0) on ``2 * pp`` stages and this rank's ``schedule`` of it."""
    import graph_exec as ge
    from graph_exec.examples import load

    num_stages = 2 * pp
    model = load("embed_lm").build(num_stages, trainable_preprocess=True, seed=0, size="tiny")
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, pp)]
    common = {"mode": mode, "loss_fn": model.loss_fn, "scale_grads": True, "timeout_s": 120.0}
    if schedule == "baseline":
        sched = ge.ScheduleInterleaved1F1B(
            stages, MICRO, model.preprocess, model.num_transpose_layers, **common
        )
    else:
        sched = ge.ScheduleMPipeTranspose(
            stages, MICRO, model.preprocess, model.num_transpose_layers, backward=backward, **common
        )
    return model, sched


def _timed_steps(model: Any, sched: Any, steps: int) -> list[float]:
    """Seconds of ``steps`` training steps, each after the optimizer's update and a barrier."""
    from mindspore import nn

    from graph_exec.transport import barrier

    optimizer = nn.Adam(sched.trainable_params(), learning_rate=1e-3)
    seconds = []
    for step in range(1, steps + 1):
        optimizer(tuple(sched.grads().values()))
        sched.zero_grad()
        inputs, labels = model.batch(step, BATCH)
        barrier()
        start = time.perf_counter()
        sched.run(*inputs, labels=labels)
        _wait_for_step(sched)
        seconds.append(time.perf_counter() - start)
    return seconds


def _wait_for_step(sched: Any) -> None:
    """Wait until the step's gradients exist (dispatch may be asynchronous)."""
    from graph_exec.device import wait_for

    wait_for(sched.grads().values())


def worker(args: Any) -> int:
    from mindspore.communication import get_group_size, get_rank, init

    from graph_exec.device import policy
    from graph_exec.msenv import local_device_id, prepare_mindspore

    prepare_mindspore(args.device, device_id=local_device_id(args.device, 2))
    init()
    rank, pp = int(get_rank()), int(get_group_size())
    report(rank, device=policy().describe(), pid=os.getpid())
    failed = 0
    for mode in args.modes.split(","):
        for case in CASES:
            failed += not run_case(rank, pp, args.device, mode, case, args.steps)
    report(rank, done=True, failed=failed)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "MS_ROLE" in os.environ:  # a rank (or msrun's scheduler) under msrun
        return worker(args)
    lines: list[str] = []
    status = launch_and_report(
        __file__,
        [f"--device={args.device}", f"--modes={args.modes}", f"--steps={args.steps}"],
        nproc=2,
        timeout_s=args.timeout,
        heading=f"device smoke on {args.device}: 2 ranks, embed_lm tiny, M={MICRO}, batch {BATCH}",
        sink=lines.append,
    )
    records = [json.loads(line) for line in lines]
    failures = [r for r in records if r.get("ok") is False]
    finished = [r for r in records if r.get("done")]
    for record in records:
        print(json.dumps(record))
    timings = [r for r in records if "timing" in r and r["rank"] == 1]
    for r in timings:
        t = r["timing"]
        print(
            f"{r['case']:<22} step p10/p50/p90 {t['p10_ms']:.1f} / {t['p50_ms']:.1f} / {t['p90_ms']:.1f} ms"
        )
    if timings:
        by_case = {r["case"]: r["timing"]["p50_ms"] for r in timings}
        for mode in args.modes.split(","):
            base = by_case.get(f"baseline {mode}")
            for name, _, _ in CASES[:2]:
                if base and f"{name} {mode}" in by_case:
                    print(
                        f"{name} {mode}: {by_case[f'{name} {mode}'] / base:.2f}x the fair baseline's step (p50)"
                    )
    ok = status == 0 and not failures and len(finished) == 2
    print(
        f"device smoke: {'PASS' if ok else 'FAIL'} ({len(failures)} failed checks, {len(finished)}/2 ranks finished)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
