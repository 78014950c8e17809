"""Where one rank's training step goes: compute, communication, and the runtime's own Python.

``python -m graph_exec.benchmarks.runtime_overhead [example] [size] [steps] [--mode MODE]``
(default ``vl_tower small 20``, graph mode, 2 ranks, MPipe with the example's default
preprocess) launches itself under msrun. After two warm-up steps every rank times each ``run()`` and,
by wrapping this rank's executor hooks, the runtime's result waits and its transport calls,
splits it into

- ``compute``: executor hooks (compiled kernels) and waiting for their results;
- ``send``: packing messages (the transport's ``send`` less the MindSpore ``isend`` inside it:
  signature check, staging copy, prefix words);
- ``wait``: communication: MindSpore's ``isend`` (on CPU it hands the data over before it
  returns, so a large message's transfer is here) and the other transport calls (receives,
  including waiting for the peer; collectives);
- ``runtime``: the rest of ``run()``, i.e. the driver's own work per step (walking the plan,
  caches, receive buffers, timeline, batch splitting).

It prints p10/p50/p90 over the measured steps, per rank, in milliseconds, and the share of the
step that is ``runtime + send``: the runtime's own work, neither compute nor communication.
(``graph-exec bench``'s overhead column is coarser: it counts whole send steps, the transfer
included, plus a calibrated per-call dispatch cost.) The wrappers add a few microseconds per
call, billed to ``runtime``.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from graph_exec.benchmarks.common import CommTimed, argument_parser, launch_and_report, p10_p50_p90, timed

HOOKS = ("stage_forward", "stage_backward", "last_stage_step", "preprocess_forward", "preprocess_backward")
TRANSPORT = ("send", "recv", "broadcast", "all_reduce_sum")
WARMUP = 2


def _worker(example: str, size: str, steps: int, mode: str) -> None:
    from mindspore.communication import get_group_size, get_rank, init

    import graph_exec as ge
    from graph_exec.examples import load
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    init()
    rank, ranks = get_rank(), get_group_size()
    num_stages = 2 * ranks
    micro = 2 * ranks
    model = load(example).build(
        num_stages, trainable_preprocess=load(example).trainable_by_default, size=size
    )
    stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, ranks)]
    schedule = ge.ScheduleMPipeTranspose(
        stages, micro, model.preprocess, model.num_transpose_layers, loss_fn=model.loss_fn, mode=mode
    )
    totals: dict[str, float] = defaultdict(float)
    samples: dict[str, list[float]] = defaultdict(list)
    for index in range(WARMUP + steps):
        inputs, labels = model.batch(index, 2 * micro)
        if index == WARMUP:  # set up by now: wrap this rank's executor, waits and transport
            runtime = schedule._setup.runtime
            for name in HOOKS:
                setattr(runtime.executor, name, timed(totals, "compute", getattr(runtime.executor, name)))
            runtime._settle = timed(totals, "compute", runtime._settle)
            for name in TRANSPORT:
                key = "send" if name == "send" else "wait"
                setattr(runtime.transport, name, timed(totals, key, getattr(runtime.transport, name)))
            runtime.transport._p2p = CommTimed(runtime.transport._p2p, totals, ("isend",))
        totals.clear()
        start = time.perf_counter()
        schedule.run(*inputs, labels=labels)
        wall = time.perf_counter() - start
        if index >= WARMUP:
            samples["step"].append(wall)
            totals["send"] -= totals["isend"]  # handing the data over is communication
            totals["wait"] += totals["isend"]
            own = wall - totals["compute"] - totals["send"] - totals["wait"]
            for key in ("compute", "send", "wait"):
                samples[key].append(totals[key])
            samples["runtime"].append(own)
            samples["share"].append((own + totals["send"]) / wall)
        schedule.zero_grad()
    parts = []
    for key in ("step", "compute", "send", "wait", "runtime"):
        parts.append(f"{key} {'/'.join(f'{v * 1e3:.2f}' for v in p10_p50_p90(samples[key]))}")
    share = "/".join(f"{v * 100:.1f}" for v in p10_p50_p90(samples["share"]))
    print(f"RESULT rank {rank}: {'  '.join(parts)} ms  (runtime+send)/step {share} %", flush=True)


def main(argv: list[str]) -> int:
    from graph_exec.examples import EXAMPLES

    parser = argument_parser(__doc__, "runtime_overhead")
    parser.add_argument("example", nargs="?", choices=tuple(EXAMPLES), default="vl_tower")
    parser.add_argument("size", nargs="?", choices=("tiny", "small"), default="small")
    parser.add_argument("steps", nargs="?", type=int, default=20, help="measured steps (default 20)")
    parser.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"steps must be at least 1, got {args.steps}")
    example, size, steps, mode = args.example, args.size, args.steps, args.mode
    return launch_and_report(
        __file__,
        ["worker", example, size, str(steps), mode],
        nproc=2,
        timeout_s=900,
        heading=(
            f"{example} {size}, 2 ranks, {mode} mode, MPipe: one run() split per rank, p10/p50/p90 over "
            f"{steps} steps after {WARMUP} warm-up steps:"
        ),
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main(sys.argv[1:]))
