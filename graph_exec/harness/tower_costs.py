"""Start-up calibration of ``graph-exec bench qwen2vl --tower-ratio``: what one chunk, one decoder
layer and one vision block cost on this machine.

Run by the bench in a process of its own, bound to one core as a rank would be (``python -m
graph_exec.harness.tower_costs SIZE STAGES ROWS DEVICE [pin]``, ``pin`` as the bench's ranks
are pinned on CPU); prints one line, :data:`RESULT` followed by
the JSON of a :class:`~graph_exec.report.tower_sweep.StartupCosts`. Every time is the median of
calls on one micro-batch, after warm-up calls that compile:

- one even-split chunk's forward (stage 1, the first chunk that is only decoder layers) *as
  the pipeline runs it*: the graph executor's ``stage_forward``, which records what the backward
  needs (about 1.4x a plain ``mindspore.jit`` forward of the same chunk: 1.7 against 1.2 ms,
  tiny, here). Calibrated against the plain forward, the tower at "R = 4" was R ≈ 1.5 of the
  chunks the launch ran (``docs/performance.md``);
- one decoder layer's forward + backward: that chunk's ``stage_forward`` and ``stage_backward``
  through the same executor, over its layer count;
- the vision tower with one and with :data:`DEEP` blocks, compiled (``mindspore.jit``: the
  frozen tower's forward records nothing, and costs the same through the executor): a third of
  their difference is one block's forward, the rest the tower's fixed part (patch embedding and
  merger). One block's forward is a few milliseconds, the size of this machine's noise: a
  one-block difference once came out at zero and asked for a thousand blocks.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

RESULT = "@@tower-costs "
REPEATS = 15
#: The deeper tower of the calibration (its difference to one block is DEEP - 1 blocks).
DEEP = 4


def timed(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], repeats: int = REPEATS) -> list[float]:
    """The median seconds of each ``(fn, args)`` of ``calls``, timed in turns (one call of each,
    then again) so that the machine's noise and the process's warming up hit them alike."""
    from graph_exec.device import wait_for

    def once(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
        begin = time.perf_counter()
        out = fn(*args)
        wait_for(out if isinstance(out, tuple | list) else (out,))
        return time.perf_counter() - begin

    for fn, args in calls:  # the first compiles
        once(fn, args), once(fn, args)
    samples = [[once(fn, args) for fn, args in calls] for _ in range(repeats)]
    return [statistics.median(turn[i] for turn in samples) for i in range(len(calls))]


def chunk_seconds(
    executor: Any, stage: int, hidden: tuple[Any, ...], repeats: int = REPEATS
) -> list[tuple[float, float]]:
    """Seconds of ``stage``'s ``F`` and of ``F`` + ``B`` through ``executor`` (its
    ``stage_forward`` records what the backward needs, as in a pipeline step), one micro-batch
    of input ``hidden`` per call, after two calls that compile: one pair per repeat."""
    from mindspore import ops

    from graph_exec.device import wait_for
    from graph_exec.kernels import FLOAT_DTYPES

    micros = itertools.count()

    def forward_and_backward() -> tuple[float, float]:
        micro = next(micros)
        begin = time.perf_counter()
        outputs = executor.stage_forward(stage, micro, hidden)
        wait_for(outputs)
        forward = time.perf_counter() - begin
        cotangents = tuple(ops.ones_like(o) if o.dtype in FLOAT_DTYPES else None for o in outputs)
        wait_for(tuple(g for g in executor.stage_backward(stage, micro, cotangents) if g is not None))
        return forward, time.perf_counter() - begin

    forward_and_backward(), forward_and_backward()  # the first compiles
    return [forward_and_backward() for _ in range(repeats)]


def measure(size: str, num_stages: int, rows: int):  # -> StartupCosts
    """The :class:`StartupCosts` of the qwen2vl example of preset ``size`` split ``num_stages`` ways."""
    import mindspore as ms

    from graph_exec.examples import qwen2vl
    from graph_exec.executors.graph import GraphExecutor
    from graph_exec.report.tower_sweep import StartupCosts

    calls = []
    for depth in (1, DEEP):
        model = qwen2vl.build(num_stages, size=size, vision_depth=depth)
        inputs, _ = model.batch(0, rows)
        calls.append((ms.jit(model.preprocess), inputs))
    towers = timed(calls)
    block = (towers[1] - towers[0]) / (DEEP - 1)
    if block <= 0:
        raise RuntimeError(
            f"the tower with {DEEP} vision blocks ({towers[1] * 1e3:.2f} ms) was not slower than with one "
            f"({towers[0] * 1e3:.2f} ms): the machine is too noisy to calibrate; run the bench again"
        )
    chunk = model.stages[1]
    layers = len(chunk.blocks)
    hidden = tuple(model.stages[0](*model.preprocess(*inputs)))
    executor = GraphExecutor({1: chunk}, loss_fn=model.loss_fn, last_stage=num_stages - 1)
    samples = chunk_seconds(executor, 1, hidden)
    chunk_forward = statistics.median(f for f, _ in samples)
    layer_step = statistics.median(t for _, t in samples) / max(layers, 1)
    return StartupCosts(
        chunk_forward=chunk_forward,
        layer_step=layer_step,
        tower_fixed=max(towers[0] - block, 0.0),
        tower_block=block,
        layers_per_chunk=layers,
    )


def main(argv: list[str]) -> int:
    size, num_stages, rows, device = argv[0], int(argv[1]), int(argv[2]), argv[3]
    if argv[4:] == ["pin"]:  # like a rank bound to its core (before MindSpore starts its threads)
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore(device)
    costs = measure(size, num_stages, rows)
    print(RESULT + json.dumps(asdict(costs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
