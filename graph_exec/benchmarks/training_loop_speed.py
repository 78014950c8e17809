"""What the training-loop features cost: a step with clipping and dynamic loss scaling against a
plain step, and ``evaluate()`` against the forward share of ``run()``.

``python -m graph_exec.benchmarks.training_loop_speed [example] [size] [steps] [--runs N]
[--mode MODE]`` (default ``embed_lm small 60``, three runs, graph mode) launches itself under
msrun on 2 ranks, ``N`` times. Each launch trains three schedules of the same model (same seed,
same batches), step by step in turn so machine noise hits them alike, MPipe with the example's
default preprocess, ``V = 2``, ``M = 4``:

- ``plain``: ``run()`` then ``step(optimizer)`` (no scaler, no clipping: the loop before these
  features, one call);
- ``loop``: ``loss_scaler=DynamicLossScaler(2**16, 2, 1000)`` and ``step(optimizer,
  max_norm=1.0)``: the scale as a graph input, the unscale with the overflow check and the
  norm's share in one pass, one small all-reduce for the verdict and the norm, the clip;
- ``control``: a second ``plain``. ``control / plain`` is what the method reads for two
  identical schedules: the resolution any ``loop / plain`` figure has on this machine.

The order of the three rotates from step to step (each schedule is first, second and third
equally often), so that what being run right after another schedule costs (caches, the
collector) falls on every schedule alike.

Every measured step starts after a barrier; a rank's time is its ``run()`` plus ``step()``.
Then the same schedules run their steps **in a row**, as a training loop does: rounds of five
steps with no barrier between them (a round starts after one; the order of the schedules
rotates from round to round), a step's time being the round's over five on its slowest rank.
There the loop's agreement at the end of a step no longer adds a wait that ``plain`` would
not have: the next step's transfers make the ranks wait for each other anyway. On
a busy machine those spread widely, so the loop's own work is also timed directly: on every
rank the calls it adds (reading the scale and handing it to the graphs, the executor's
``unscale_and_check``, the scaler's ``adjust``, ``step()``'s verdict and clipping; wrapped)
and, after the training steps, its one agreement (the all-reduce of a few int64 words, each
call after a barrier: the latency without a wait for a late peer). ``plain`` (no scaler, no
clipping) checks its gradients' finiteness in ``step()`` since issue 39.2: one pass and one
small all-reduce that figures measured before then do not include. Each
rank's end of step (``StepEnd.begin`` and ``finish`` plus ``step()``) is printed too, but it
includes waits: the loop's agreement waits for the slower rank where ``plain``'s end of step
meets nobody, so its difference is not the loop's cost.
After the training steps each rank times ``evaluate()`` (with labels) on the ``plain``
schedule, and takes from ``plain``'s timelines the forward share of its ``run()``: the
``F`` steps of every stage but the last (whose ``F`` is the fused forward, loss and backward),
the preprocess forwards and the transfers of forward data. A step lasts until its slowest rank
is done; rank 0 prints p10/p50/p90 of that in milliseconds, the p50 ratio ``loop / plain``
(the target is below 1.03 in graph mode), the same ratio step by step (each ``loop`` step over
the ``plain`` step of the same round, on the same batch: a slow spell of the machine hits both),
the same two figures for ``control / plain``, the loop's own work (the slowest rank's
calls plus the agreement's p50 latency) against ``plain``'s step, and ``evaluate``
against the forward share.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

from graph_exec.benchmarks.common import argument_parser, launch_and_report, p10_p50_p90, timed

WARMUP = 3
#: Steps run back to back, without a barrier, in each round of the second measurement.
IN_A_ROW = 5
RANKS, VPP, MICRO = 2, 2, 4
#: The schedules each launch trains; ``control`` is a second ``plain`` (the method's resolution).
VARIANTS = ("plain", "loop", "control")
#: Plan steps that make up the forward half of a training step (``F`` of the last stage excepted).
FORWARD_KINDS = ("F", "Fsend", "Frecv", "TFWD", "OUTsend", "OUTrecv", "BCAST")


def _forward_seconds(timeline, last_stage: int) -> float:
    from graph_exec.schedule import Step, StepKind

    total = 0.0
    for event in timeline:
        step = Step.parse(event.step)
        if step.kind.value in FORWARD_KINDS and not (step.kind is StepKind.F and step.stage == last_stage):
            total += event.end - event.start
    return total


def _agreement_seconds(transport, calls: int) -> list[float]:
    """Seconds of the loop's one agreement (a SUM all-reduce of a few float32) over
    ``transport``, each call after a barrier: its latency without a wait for a late peer."""
    import mindspore as ms
    import numpy as np

    from graph_exec.transport import barrier

    seconds = []
    for _ in range(calls):
        values = ms.Tensor(np.zeros(3, np.float32))
        barrier()
        start = time.perf_counter()
        transport.all_reduce_sum([values])
        values.asnumpy()
        seconds.append(time.perf_counter() - start)
    return seconds


def _build_runs(example: str, size: str, mode: str, rank: int) -> dict:
    """The three schedules of :data:`VARIANTS` on this rank: ``name -> (model, schedule, optimizer)``,
    the same model and seed each, ``loop`` alone with a loss scaler."""
    from mindspore import amp, nn

    import graph_exec as ge
    from graph_exec.examples import load

    num_stages = VPP * RANKS
    family = load(example)
    runs = {}
    for name in VARIANTS:
        model = family.build(num_stages, trainable_preprocess=family.trainable_by_default, size=size)
        stages = [ge.PipelineStage(model.stages[s], s, num_stages) for s in range(rank, num_stages, RANKS)]
        scaler = amp.DynamicLossScaler(2.0**16, 2, 1000) if name == "loop" else None
        sched = ge.ScheduleMPipeTranspose(
            stages,
            MICRO,
            model.preprocess,
            model.num_transpose_layers,
            loss_fn=model.loss_fn,
            mode=mode,
            scale_grads=True,
            loss_scaler=scaler,
        )
        runs[name] = (model, sched, nn.Adam(sched.trainable_params(), learning_rate=1e-3))
    return runs


def _time_end_of_step(sched, name: str, ends: dict[str, float]) -> None:
    """Wrap ``sched``'s end of step so ``ends[name]`` adds up its time; for ``loop`` also the
    calls the loop adds (but for its meeting) into ``ends["own"]``. Done once set up, after warm-up."""
    step_end = sched._setup.step_end
    step_end.begin = timed(ends, name, step_end.begin)
    step_end.finish = timed(ends, name, step_end.finish)
    if name == "loop":  # the loop's own work, but for its meeting
        for owner, method in (
            (step_end.executor, "set_loss_scale"),
            (step_end.executor, "unscale_and_check"),
            (step_end.loss_scale, "value"),
            (step_end.loss_scale, "adjust"),
            (step_end.gate, "before_update"),  # step()'s verdict and clipping
        ):
            setattr(owner, method, timed(ends, "own", getattr(owner, method)))


def _barrier_steps(runs: dict, steps: int, samples: dict[str, list[float]]) -> None:
    """The first measurement: every step after a barrier, the schedules in rotating order."""
    from graph_exec.transport import barrier

    ends: dict[str, float] = defaultdict(float)
    for index in range(WARMUP + steps):
        turn = index % len(VARIANTS)  # the order rotates: each schedule leads equally often
        for name in VARIANTS[turn:] + VARIANTS[:turn]:
            model, sched, optimizer = runs[name]
            inputs, labels = model.batch(index, 2 * MICRO)
            if index == WARMUP:  # set up by now: time every end of step from here on
                _time_end_of_step(sched, name, ends)
            ends[name] = ends["own"] = 0.0
            barrier()
            start = time.perf_counter()
            sched.run(*inputs, labels=labels)
            middle = time.perf_counter()
            sched.step(optimizer, max_norm=1.0 if name == "loop" else None)
            end = time.perf_counter()
            if index >= WARMUP:
                samples[name].append(end - start)
                samples[f"{name} end"].append(ends[name] + end - middle)
                if name == "plain":
                    samples["forward"].append(_forward_seconds(sched.timeline, VPP * RANKS - 1))
                if name == "loop":
                    samples["own"].append(ends["own"])


def _steps_in_a_row(runs: dict, steps: int, samples: dict[str, list[float]]) -> None:
    """The second measurement: rounds of :data:`IN_A_ROW` steps with no barrier between them."""
    from graph_exec.transport import barrier

    for index in range(max(1, steps // IN_A_ROW) * len(VARIANTS)):
        name = VARIANTS[(index - index // len(VARIANTS)) % len(VARIANTS)]  # each first equally often
        model, sched, optimizer = runs[name]
        barrier()
        start = time.perf_counter()
        for step in range(IN_A_ROW):
            inputs, labels = model.batch(WARMUP + steps + index * IN_A_ROW + step, 2 * MICRO)
            sched.run(*inputs, labels=labels)
            sched.step(optimizer, max_norm=1.0 if name == "loop" else None)
        samples[f"{name} in a row"].append((time.perf_counter() - start) / IN_A_ROW)


def _evaluate_seconds(model, sched, steps: int) -> list[float]:
    """Seconds of ``evaluate()`` (with labels) after a barrier, ``steps`` times after warm-up."""
    from graph_exec.transport import barrier

    seconds = []
    for index in range(WARMUP + steps):
        inputs, labels = model.batch(10_000 + index, 2 * MICRO)
        barrier()
        start = time.perf_counter()
        sched.evaluate(*inputs, labels=labels)
        if index >= WARMUP:
            seconds.append(time.perf_counter() - start)
    return seconds


def _ms(values: list[float]) -> str:
    """p10/p50/p90 of ``values`` (seconds) in milliseconds."""
    return "/".join(f"{v * 1e3:.1f}" for v in p10_p50_p90(values))


def _report_barrier_steps(everyone: list[dict], steps: int) -> dict[str, list[float]]:
    """Print the barrier-started steps' figures; return each variant's (and ``evaluate``'s)
    slowest-rank seconds step by step: a step lasts until its slowest rank is done."""
    slowest = {k: [max(r[k][i] for r in everyone) for i in range(steps)] for k in (*VARIANTS, "evaluate")}
    print(
        f"RESULT step (slowest rank): {'  '.join(f'{k} {_ms(slowest[k])}' for k in VARIANTS)} ms",
        flush=True,
    )
    for name in ("loop", "control"):
        ratio = statistics.median(slowest[name]) / statistics.median(slowest["plain"])
        paired = p10_p50_p90([a / b for a, b in zip(slowest[name], slowest["plain"], strict=True)])
        print(
            f"RESULT {name}/plain {ratio:.3f}; step by step (p10/p50/p90) "
            f"{'/'.join(f'{r:.3f}' for r in paired)}",
            flush=True,
        )
    return slowest


def _report_in_a_row(everyone: list[dict]) -> None:
    """Print the steps-in-a-row figures (a round's time over its steps, slowest rank)."""
    rounds = len(everyone[0]["plain in a row"])
    row = {k: [max(r[f"{k} in a row"][i] for r in everyone) for i in range(rounds)] for k in VARIANTS}
    print(
        f"RESULT steps in a row ({rounds} rounds of {IN_A_ROW}, no barrier between steps; ms a step, "
        f"slowest rank): {'  '.join(f'{k} {_ms(row[k])}' for k in VARIANTS)}; "
        + "  ".join(
            f"{k}/plain {statistics.median(row[k]) / statistics.median(row['plain']):.3f}"
            for k in ("loop", "control")
        ),
        flush=True,
    )


def _report_evaluate_and_own(everyone: list[dict], steps: int, slowest: dict[str, list[float]]) -> None:
    """Print ``evaluate`` against ``run()``'s forward share, and the loop's own work against
    ``plain``'s step."""
    forward = statistics.median(max(r["forward"][i] for r in everyone) for i in range(steps))
    print(
        f"RESULT evaluate (slowest rank) {_ms(slowest['evaluate'])} ms against run()'s forward share "
        f"(slowest rank, p50) {forward * 1e3:.1f} ms: {p10_p50_p90(slowest['evaluate'])[1] / forward:.2f}",
        flush=True,
    )
    own = [
        max(r["own"][i] for r in everyone) + statistics.median(everyone[0]["agreement"]) for i in range(steps)
    ]
    print(
        f"RESULT loop's own work (the slowest rank's scale read and hand-over, unscale-check pass, "
        f"scaler adjust and clip, plus the agreement's all-reduce when both ranks arrive together): "
        f"{_ms(own)} ms, "
        f"{statistics.median(own) / statistics.median(slowest['plain']):.1%} of plain's step (p50)",
        flush=True,
    )


def _worker(example: str, size: str, steps: int, mode: str) -> None:
    """One rank: train the three schedules both ways, time ``evaluate``, and print the figures."""
    from mindspore.communication import get_rank, init

    from graph_exec.msenv import prepare_mindspore
    from graph_exec.transport import all_gather_objects

    prepare_mindspore("CPU")
    init()
    rank = get_rank()
    runs = _build_runs(example, size, mode, rank)
    samples: dict[str, list[float]] = defaultdict(list)
    _barrier_steps(runs, steps, samples)
    _steps_in_a_row(runs, steps, samples)
    samples["agreement"] = _agreement_seconds(runs["loop"][1]._setup.step_end._pipeline, steps)
    samples["evaluate"] = _evaluate_seconds(*runs["plain"][:2], steps)
    everyone = all_gather_objects(dict(samples), 300.0, "gathering the timings")
    if rank == 0:  # a step lasts until its slowest rank is done (every step starts at a barrier)
        slowest = _report_barrier_steps(everyone, steps)
        _report_in_a_row(everyone)
        _report_evaluate_and_own(everyone, steps, slowest)
    ends_ms = "  ".join(f"{name} {_ms(samples[f'{name} end'])}" for name in VARIANTS)
    print(
        f"RESULT rank {rank}: end of step (begin + finish + step(), waits for peers included): {ends_ms} ms; "
        f"forward share {_ms(samples['forward'])} ms",
        flush=True,
    )


def main(argv: list[str]) -> int:
    from graph_exec.examples import EXAMPLES

    parser = argument_parser(__doc__, "training_loop_speed")
    parser.add_argument("example", nargs="?", choices=tuple(EXAMPLES), default="embed_lm")
    parser.add_argument("size", nargs="?", choices=("tiny", "small"), default="small")
    parser.add_argument("steps", nargs="?", type=int, default=60, help="measured steps (default 60)")
    parser.add_argument("--runs", type=int, default=3, help="launches, each measured on its own (default 3)")
    parser.add_argument("--mode", choices=("graph", "pynative"), default="graph")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.runs < 1:
        parser.error(f"steps and --runs must be at least 1, got {args.steps} and {args.runs}")
    status = 0
    for run in range(1, args.runs + 1):
        status |= launch_and_report(
            __file__,
            ["worker", args.example, args.size, str(args.steps), args.mode],
            nproc=RANKS,
            timeout_s=1800,
            heading=(
                f"run {run}/{args.runs}: {args.example} {args.size}, {RANKS} ranks, {args.mode} mode, V={VPP} "
                f"M={MICRO}, p10/p50/p90 of {args.steps} steps after {WARMUP} warm-up steps:"
            ),
        )
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main(sys.argv[1:]))
