"""Calibrate a :class:`~graph_exec.tune.ModelCosts` by measurement, once, on one micro-batch.

``graph-exec tune EXAMPLE`` runs :func:`main` in a process of its own, bound to one core as a
rank would be (``python -m graph_exec.harness.model_costs EXAMPLE SIZE ROWS DEVICE OPTIONS_JSON
[pin]``), and reads the one line :data:`RESULT` + the JSON of the costs; a user's own model calls
:func:`calibrate` directly with its chunks. Compute is timed the way the tower sweep's start-up
calibration times it (:mod:`graph_exec.harness.tower_costs`: each stage through the graph
executor's ``stage_forward``/``stage_backward``, which record the tape as a pipeline step does,
medians of alternating calls after the compiling ones); the preprocess through the executor's
own preprocess calls. Sizes are counted from the tensors: a stage boundary, the preprocess
output, the parameters. A layer's tape is what memory grows by while :data:`KEPT` forwards of a
middle stage are held (`graph_exec.device.memory_in_use`) — an estimate, which
is why the cost file is written for the user to read and edit. Transfer latency and bandwidth
need two ranks: ``graph-exec tune`` measures them in a short launch of the fair baseline
(:func:`graph_exec.report.predict.measured_costs`), a user passes them in.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from graph_exec.cost_file import CostFileError, ModelCosts
from graph_exec.device import memory_in_use
from graph_exec.harness.tower_costs import REPEATS, chunk_seconds, timed

RESULT = "@@model-costs "
#: Forwards of a middle stage held at once to see what one tape weighs.
KEPT = 8


def calibrate(
    stages: Sequence[Any],
    layers_per_stage: Sequence[int],
    hidden: tuple[Any, ...],
    labels: tuple[Any, ...],
    loss_fn: Any,
    *,
    layers: int | None = None,
    preprocess: Any = None,
    preprocess_inputs: tuple[Any, ...] = (),
    trainable_preprocess: bool = False,
    latency: float = 0.0,
    bandwidth: float = float("inf"),
    optimizer_bytes_per_param_byte: float = 2.0,
    repeats: int = REPEATS,
) -> ModelCosts:
    """The costs of a model cut into ``stages`` (at least 3 cells: first, middle…, last, each
    with ``layers_per_stage`` decoder layers), measured on one micro-batch.

    ``hidden``: stage 0's input for one micro-batch (the preprocess's output, or the model's
    input); ``labels``: that micro-batch's labels for ``loss_fn(output, *labels)`` on the last
    stage; ``layers``: the decoder layers of the model to plan (default: the sum of
    ``layers_per_stage``); ``preprocess`` with ``preprocess_inputs``: the replicated block
    (``hidden`` is then its output). Per-layer figures come from the middle stages; what stage 0
    and the last stage do besides their layers (embedding, head and loss) are their own entries.
    """

    from graph_exec.executors.graph import GraphExecutor

    middle = _measured_middle(stages, layers_per_stage)
    last = len(stages) - 1
    executor = GraphExecutor(
        dict(enumerate(stages)),
        preprocess=preprocess,
        loss_fn=loss_fn,
        last_stage=last,
        first_stage_input_grads=False,
    )
    inputs = _stage_inputs(stages, hidden)
    seconds = {s: chunk_seconds(executor, s, inputs[s], repeats) for s in [0, *middle]}
    fwd = {s: statistics.median(f for f, _ in seconds[s]) for s in seconds}
    bwd = {s: statistics.median(t for _, t in seconds[s]) - fwd[s] for s in seconds}
    layer_forward = statistics.fmean(fwd[s] / layers_per_stage[s] for s in middle)
    layer_backward = statistics.fmean(bwd[s] / layers_per_stage[s] for s in middle)
    last_step = _last_stage_seconds(executor, last, inputs[last], labels, repeats)
    # a layer's tape holds at least its input: the floor where memory grew by less than a page
    tape = max(
        _tape_bytes(executor, middle[0], inputs[middle[0]]) / layers_per_stage[middle[0]], _nbytes(inputs[1])
    )
    pre: dict[str, Any] = {"preprocess": "none"}
    if preprocess is not None:
        pre = _preprocess_costs(executor, preprocess, preprocess_inputs, trainable_preprocess, repeats)
    params = [_param_bytes(cell) for cell in stages]
    layer_params = statistics.fmean(params[s] / layers_per_stage[s] for s in middle)
    return ModelCosts(
        layers=layers or sum(layers_per_stage),
        micro_batch_size=int(hidden[0].shape[0]),
        layer_forward=layer_forward,
        layer_backward=max(layer_backward, 0.0),
        layer_activation_bytes=max(round(tape), 0),
        layer_param_bytes=round(layer_params),
        hidden_bytes=_nbytes(inputs[1]),
        first_stage_forward=max(fwd[0] - layers_per_stage[0] * layer_forward, 0.0),
        first_stage_backward=max(bwd[0] - layers_per_stage[0] * layer_backward, 0.0),
        last_stage_forward=max(last_step - layers_per_stage[last] * (layer_forward + layer_backward), 0.0),
        first_stage_param_bytes=max(round(params[0] - layers_per_stage[0] * layer_params), 0),
        last_stage_param_bytes=max(round(params[last] - layers_per_stage[last] * layer_params), 0),
        optimizer_bytes_per_param_byte=optimizer_bytes_per_param_byte,
        latency=latency,
        bandwidth=bandwidth,
        **pre,
    )


def _measured_middle(stages: Sequence[Any], layers_per_stage: Sequence[int]) -> list[int]:
    """The middle stages with decoder layers (where per-layer figures come from); a clear error
    when there are fewer than 3 stages, a count is missing or no middle stage has a layer."""
    if len(stages) < 3 or len(layers_per_stage) != len(stages):
        raise ValueError(
            f"calibrate needs at least 3 stages (first, middle, last) with a layer count each, got "
            f"{len(stages)} stages and {len(layers_per_stage)} counts"
        )
    middle = [s for s in range(1, len(stages) - 1) if layers_per_stage[s] > 0]
    if not middle:
        raise ValueError(f"no middle stage has a decoder layer to measure: {list(layers_per_stage)}")
    return middle


def _stage_inputs(stages: Sequence[Any], hidden: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Each stage's input for the micro-batch: ``hidden``, then every stage's forward output."""
    inputs = [tuple(hidden)]
    for cell in stages[:-1]:
        out = cell(*inputs[-1])
        inputs.append(out if isinstance(out, tuple) else (out,))
    return inputs


def _last_stage_seconds(
    executor: Any, last: int, inputs: tuple[Any, ...], labels: tuple[Any, ...], repeats: int
) -> float:
    """Seconds of the last stage's fused forward, loss and backward (a fresh micro-batch id each run)."""
    steps = iter(range(10**9))
    (seconds,) = timed(
        [(lambda: executor.last_stage_step(last, next(steps), inputs, labels)[0], ())], repeats
    )
    return seconds


def _preprocess_costs(
    executor: Any, preprocess: Any, inputs: tuple[Any, ...], trainable: bool, repeats: int
) -> dict[str, Any]:
    """The preprocess's forward (and, trainable, its backward from the tape) and sizes."""
    from mindspore import ops

    from graph_exec.device import wait_for

    (forward,) = timed([(lambda: executor.preprocess_forward(inputs, {}), ())], repeats)
    outputs = executor.preprocess_forward(inputs, {})
    entry: dict[str, Any] = {
        "preprocess": "trainable" if trainable else "frozen",
        "preprocess_forward": forward,
        "preprocess_output_bytes": _nbytes(outputs),
        "preprocess_param_bytes": _param_bytes(preprocess),
    }
    if trainable:
        keys = iter(range(10**9))
        ones = tuple(ops.ones_like(o) for o in outputs)

        def taped() -> float:
            key = next(keys)
            wait_for(executor.preprocess_forward_taped(key, inputs, {}))
            middle = time.perf_counter()
            executor.preprocess_backward_taped(key, ones)
            wait_for(ones)
            return time.perf_counter() - middle

        taped(), taped()
        entry["preprocess_backward"] = statistics.median(taped() for _ in range(repeats))
        entry["preprocess_tape_bytes"] = entry["preprocess_output_bytes"]  # at least what it returns
    return entry


def _tape_bytes(executor: Any, stage: int, hidden: tuple[Any, ...]) -> float:
    """What one held forward of ``stage`` adds to memory (median of :data:`KEPT` increments)."""
    from mindspore import ops

    from graph_exec.device import wait_for
    from graph_exec.kernels import FLOAT_DTYPES

    base = 10**8
    outputs = executor.stage_forward(stage, base, hidden)  # warm the allocator
    wait_for(outputs)
    grown, before = [], memory_in_use()
    for k in range(1, KEPT + 1):
        outputs = executor.stage_forward(stage, base + k, hidden)
        wait_for(outputs)
        now = memory_in_use()
        grown.append(now - before)
        before = now
    cotangents = tuple(ops.ones_like(o) if o.dtype in FLOAT_DTYPES else None for o in outputs)
    for k in range(KEPT + 1):
        executor.stage_backward(stage, base + k, cotangents)
    return float(statistics.median(grown))


def _nbytes(tensors: Sequence[Any]) -> int:
    return sum(int(t.nbytes) for t in tensors)


def _param_bytes(cell: Any) -> int:
    return sum(int(p.nbytes) for p in cell.get_parameters())


def example_costs(example: str, size: str, rows: int, layers: int, options: dict | None = None) -> ModelCosts:
    """The costs of a built-in example, built in 3 stages so that stage 1 is layers only;
    ``layers`` 0: the example's own layer count at ``size`` (what ``build`` makes for one stage)."""
    from graph_exec.examples import load

    build = load(example).build
    if not layers:
        layers = sum(len(cell.blocks) for cell in _bodies(build(1, size=size, **(options or {})).stages))
    model = build(3, size=size, **(options or {}))
    inputs, labels = model.batch(0, rows)
    hidden = inputs
    if model.preprocess is not None:
        out = model.preprocess(*inputs)
        hidden = out if isinstance(out, tuple) else (out,)
    trainable = model.preprocess is not None and any(
        p.requires_grad for p in model.preprocess.get_parameters()
    )
    return calibrate(
        model.stages,
        [len(cell.blocks) for cell in _bodies(model.stages)],
        hidden,
        labels if isinstance(labels, tuple) else (labels,),
        model.loss_fn,
        layers=layers,
        preprocess=model.preprocess,
        preprocess_inputs=inputs,
        trainable_preprocess=trainable,
    )


def _bodies(stages: Sequence[Any]) -> list[Any]:
    """Each stage's run of decoder layers (``blocks``), the first stage's possibly wrapped."""
    out = []
    for cell in stages:
        while not hasattr(cell, "blocks"):
            inner = [c for c in cell.cells() if hasattr(c, "blocks") or any(True for _ in c.cells())]
            if not inner:
                raise CostFileError(f"cannot count the decoder layers of {type(cell).__name__}")
            cell = inner[-1]
        out.append(cell)
    return out


def main(argv: list[str]) -> int:
    example, size, rows, layers, device, options = argv[:6]
    if argv[6:] == ["pin"]:  # like a rank bound to its core (before MindSpore starts its threads)
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore(device)
    costs = example_costs(example, size, int(rows), int(layers), json.loads(options))
    print(RESULT + json.dumps(asdict(costs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
