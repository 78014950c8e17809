"""Start-up calibration of ``graph-exec bench qwen2vl --tower-ratio``: what one chunk, one decoder
layer and one vision block cost on this machine.

Run by the bench in a process of its own, bound to one core as a rank would be (``python -m
graph_exec.harness.tower_costs SIZE STAGES ROWS DEVICE [pin]``, ``pin`` as the bench's ranks
are pinned on CPU); prints one line, :data:`RESULT` followed by
the JSON of a :class:`~graph_exec.report.tower_sweep.StartupCosts`. Every time is the median of
compiled (``mindspore.jit``) calls on one micro-batch, after warm-up calls that compile:

- one even-split chunk's forward (stage 1, the first chunk that is only decoder layers);
- one decoder layer's forward + backward: that chunk's forward and gradient (inputs and
  weights) in one compiled call, over its layer count;
- the vision tower with one and with :data:`DEEP` blocks: a third of their difference is one
  block's forward, the rest the tower's fixed part (patch embedding and merger). One block's
  forward is a few milliseconds, the size of this machine's noise: a one-block difference once
  came out at zero and asked for a thousand blocks.
"""

from __future__ import annotations

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


def _timed(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int = REPEATS) -> float:
    from graph_exec.device import wait_for

    def once() -> float:
        begin = time.perf_counter()
        out = fn(*args)
        wait_for(out if isinstance(out, tuple | list) else (out,))
        return time.perf_counter() - begin

    once(), once()  # the first compiles
    return statistics.median(once() for _ in range(repeats))


def _flat(value: Any) -> tuple[Any, ...]:
    if isinstance(value, tuple | list):
        return tuple(t for v in value for t in _flat(v))
    return (value,)


def measure(size: str, num_stages: int, rows: int):  # -> StartupCosts
    """The :class:`StartupCosts` of the qwen2vl example of preset ``size`` split ``num_stages`` ways."""
    import mindspore as ms

    from graph_exec.examples import qwen2vl
    from graph_exec.report.tower_sweep import StartupCosts

    towers = []
    for depth in (1, DEEP):
        model = qwen2vl.build(num_stages, size=size, vision_depth=depth)
        inputs, _ = model.batch(0, rows)
        towers.append(_timed(ms.jit(model.preprocess), inputs))
    block = (towers[1] - towers[0]) / (DEEP - 1)
    if block <= 0:
        raise RuntimeError(
            f"the tower with {DEEP} vision blocks ({towers[1] * 1e3:.2f} ms) was not slower than with one "
            f"({towers[0] * 1e3:.2f} ms): the machine is too noisy to calibrate; run the bench again"
        )
    chunk = model.stages[1]
    layers = len(chunk.blocks)
    hidden = model.stages[0](*model.preprocess(*inputs))
    forward = _timed(ms.jit(chunk), hidden)
    weights = chunk.trainable_params()

    def loss(h: Any, positions: Any) -> Any:
        return chunk(h, positions)[0].sum()

    step = ms.jit(ms.grad(loss, grad_position=0, weights=weights))
    layer_step = _timed(lambda *a: _flat(step(*a)), hidden) / max(layers, 1)
    return StartupCosts(
        chunk_forward=forward,
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
