"""Executor speed and memory on one stage chunk: tape, recompute, eager tape, the old path.

One function per measurement, each printing side-by-side ratios with p10/p50/p90 (the cases
alternate round by round in one process, so machine noise hits them alike):

* :func:`chunk_speed` — 4 micro-batches in flight (4 forwards, then 4 backwards in another
  order) on a chunk, each path waiting for every forward output and every input gradient as a
  pipeline stage must (it sends them), for: the graph executor (jitted chunk under the tape), the pynative
  executor (eager chunk under the tape), the graph executor with ``recompute=True``, an eager
  tape written here (``GradOperation`` on the bare cell, eager ``assign_add``; the reference),
  the same with the executors' host adds (so that their gain over the reference can be split
  into accumulation and compilation), and the previous compiled
  path written here (a jitted recompute ``value_and_grad`` with in-graph ``assign_add``);
* :func:`accumulation_candidates` — ways of adding returned weight gradients into accumulators;
* :func:`last_stage_fused_vs_tape` — the fused jitted forward+loss+backward (with in-graph
  accumulation, or returning the gradients to an eager add), the taped loss forward followed by
  its bprop (the executors' previous way) and the executor's one-graph loss and gradient;
* :func:`slow_mode_candidates` — what a jitted recompute backward's outputs cost;
* :func:`recompute_backward` — the one-graph recompute backward against recording the forward
  and running its bprop;
* :func:`memory_per_micro` — bytes held per in-flight micro-batch, tape against recompute
  (each in a fresh process: MindSpore's allocator never returns memory, so growth only shows
  in a process that has not needed it before).

``--runs N`` repeats :func:`chunk_speed` in N separate processes (a slow mode, if any, lasts
for a whole process). Run ``python -m graph_exec.benchmarks.executor_speed [--help]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from graph_exec.benchmarks.common import p10_p50_p90

CHUNKS = ("dense32", "dense256", "lm_block")
MICRO = 4
BACKWARD_ORDER = (2, 0, 3, 1)


def _spread(samples: list[float]) -> tuple[float, float, float]:
    """p10, p50, p90 in milliseconds."""
    p10, p50, p90 = p10_p50_p90(samples)
    return p10 * 1e3, p50 * 1e3, p90 * 1e3


def _sync(value: Any) -> None:
    """Wait for every tensor in ``value`` (``asnumpy`` is the reliable wait on CPU)."""
    if isinstance(value, tuple | list):
        for item in reversed(value):
            _sync(item)
    elif value is not None and hasattr(value, "asnumpy"):
        value.asnumpy()


def _interleaved(cases: dict[str, Callable[[], float]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per case, the cases alternating round by round after ``warmup`` rounds."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(warmup + rounds):
        for name, case in cases.items():
            elapsed = case()
            if index >= warmup:
                samples[name].append(elapsed)
    return samples


def _print_table(title: str, samples: dict[str, list[float]], reference: str) -> dict[str, dict[str, float]]:
    print(f"\n== {title} (ms; ratio = {reference} p50 / case p50) ==")
    print(f"{'case':34s}{'p10':>9s}{'p50':>9s}{'p90':>9s}{'mean':>9s}{'p90/p50':>9s}{'ratio':>8s}")
    ref_p50 = _spread(samples[reference])[1]
    summary = {}
    for name, values in samples.items():
        p10, p50, p90 = _spread(values)
        mean = float(np.mean(values)) * 1e3
        summary[name] = {"p10": p10, "p50": p50, "p90": p90, "mean": mean}
        print(f"{name:34s}{p10:9.2f}{p50:9.2f}{p90:9.2f}{mean:9.2f}{p90 / p50:9.2f}{ref_p50 / p50:7.2f}x")
    return summary


def _setup() -> None:
    import mindspore as ms

    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    ms.set_seed(0)


def build_chunk(name: str) -> tuple[Any, tuple[int, ...]]:
    """The chunk cell and its input shape."""
    from mindspore import nn

    from graph_exec.examples.lm import Block, LMConfig

    if name == "lm_block":
        config = LMConfig(vocab=128, width=64, heads=4, layers=1, seq=32)
        cell, shape = Block(config), (2, 32, 64)
    else:
        width, rows = {"dense32": (32, 4), "dense256": (256, 64)}[name]
        cell = nn.SequentialCell([nn.SequentialCell([nn.Dense(width, width), nn.Tanh()]) for _ in range(8)])
        shape = (rows, width)
    cell.update_parameters_name(f"{name}.")
    return cell, shape


def _eager_tape(cell: Any, host_adds: bool = False) -> Callable[[list, list], list]:
    """The reference: the bare cell under the eager tape, eager ``assign_add`` into accumulators
    (``host_adds``: host adds into their memory instead, as the executors do on CPU)."""
    from mindspore import Parameter, ParameterTuple, ops

    from graph_exec.kernels.grad_buffers import make_host_accumulate

    params = ParameterTuple(cell.trainable_params())
    acc = ParameterTuple(
        [Parameter(ops.zeros_like(p), name="ref." + p.name, requires_grad=False) for p in params]
    )
    cell.set_grad(True)
    grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(cell, params)
    host_add = make_host_accumulate(acc) if host_adds else None

    def step(xs: list, cs: list) -> list:
        for x in xs:
            _sync(cell(x))
        dxs = []
        for m in BACKWARD_ORDER:
            (dx,), dws = grad(xs[m], cs[m])
            if host_add is not None:
                host_add(*dws)
            else:
                for index, dw in enumerate(dws):
                    ops.assign_add(acc[index], dw)
            _sync(dx)
            dxs.append(dx)
        return [*dxs, *acc]

    return step


def _old_compiled_path(cell: Any) -> Callable[[list, list], list]:
    """The previous graph path: forward jitted, backward a jitted recompute ``value_and_grad``
    with ``ops.assign_add`` into accumulator Parameters inside the graph."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, ops

    params = ParameterTuple(cell.trainable_params())
    buffers = ParameterTuple(
        [Parameter(ops.zeros_like(p), name="old." + p.name, requires_grad=False) for p in params]
    )

    def objective(x: Any, c: Any) -> Any:
        return (cell(x) * c).sum()

    differentiate = ms.value_and_grad(objective, grad_position=0, weights=params)

    def backward(x: Any, c: Any) -> Any:
        _, (dx, dws) = differentiate(x, c)
        for index in range(len(buffers)):
            ops.assign_add(buffers[index], dws[index])
        return dx

    def forward(x: Any) -> Any:
        return cell(x)

    jit_forward, jit_backward = ms.jit(forward), ms.jit(backward)

    def step(xs: list, cs: list) -> list:
        for x in xs:
            _sync(jit_forward(x))
        dxs = []
        for m in BACKWARD_ORDER:
            dxs.append(jit_backward(xs[m], cs[m]))
            _sync(dxs[-1])
        return dxs + list(buffers)

    return step


def _executor_path(cell: Any, mode: str, recompute: bool) -> Callable[[list, list], list]:
    from graph_exec.executors import create_executor

    executor = create_executor(mode, {1: cell}, recompute=recompute)

    def step(xs: list, cs: list) -> list:
        for m, x in enumerate(xs):
            _sync(executor.stage_forward(1, m, (x,)))
        grads = []
        for m in BACKWARD_ORDER:
            grads.extend(executor.stage_backward(1, m, (cs[m],)))
            _sync(grads[-1])
        return [*grads, *executor.grads().values()]

    return step


def chunk_speed(name: str, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """4 forwards then 4 backwards per round, every path on its own copy of the chunk."""
    from mindspore import Tensor

    _, shape = build_chunk(name)
    rng = np.random.default_rng(0)
    paths = {
        "graph (tape)": lambda cell: _executor_path(cell, "graph", False),
        "pynative (tape)": lambda cell: _executor_path(cell, "pynative", False),
        "graph recompute=True": lambda cell: _executor_path(cell, "graph", True),
        "eager tape (reference)": _eager_tape,
        "eager tape, host adds": lambda cell: _eager_tape(cell, host_adds=True),
        "old compiled path": _old_compiled_path,
    }
    steps = {label: make(build_chunk(name)[0]) for label, make in paths.items()}

    def case(step: Callable[[list, list], list]) -> Callable[[], float]:
        def run() -> float:
            xs = [Tensor(rng.standard_normal(shape, dtype=np.float32)) for _ in range(MICRO)]
            cs = [Tensor(rng.standard_normal(shape, dtype=np.float32)) for _ in range(MICRO)]
            start = time.perf_counter()
            _sync(step(xs, cs))
            return time.perf_counter() - start

        return run

    samples = _interleaved({label: case(step) for label, step in steps.items()}, rounds, warmup)
    title = f"{name}: {MICRO} forwards then {MICRO} backwards, {rounds} rounds"
    return _print_table(title, samples, "eager tape (reference)")


def accumulation_candidates(name: str, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """Taped backwards of chunk ``name`` whose weight gradients are added in different ways."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, ops

    from graph_exec.executors.tape import Tape
    from graph_exec.kernels import make_stage_forward

    cell, shape = build_chunk(name)
    params = ParameterTuple(cell.trainable_params())
    tape = Tape(make_stage_forward(cell), params, True, ms.jit)
    buffers = ParameterTuple(
        [Parameter(ops.zeros_like(p), name="cand." + p.name, requires_grad=False) for p in params]
    )
    count = len(buffers)
    candidates = _accumulation_ways(buffers)
    rng = np.random.default_rng(1)

    def case(add: Callable[[tuple], Any]) -> Callable[[], float]:
        def run() -> float:
            xs = [Tensor(rng.standard_normal(shape, dtype=np.float32)) for _ in range(MICRO)]
            c = Tensor(rng.standard_normal(shape, dtype=np.float32))
            start = time.perf_counter()
            for x in xs:
                tape(x)
            for x in xs:
                (dx,), dws = tape.backward((x,), (c,))
                add(dws)
                dx.asnumpy()
            _sync(list(buffers))
            return time.perf_counter() - start

        return run

    samples = _interleaved({label: case(add) for label, add in candidates.items()}, rounds, warmup)
    return _print_table(
        f"weight-gradient accumulation ({count} tensors), {name}, 4 taped fwd + 4 bwd",
        samples,
        "eager assign_add per parameter",
    )


def _accumulation_ways(buffers: Any) -> dict[str, Callable[[tuple], Any]]:
    """``label -> add(one micro-batch's weight gradients)`` into ``buffers``, each way measured by
    :func:`accumulation_candidates`."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.common.api import _pynative_executor

    from graph_exec.kernels import make_accumulate
    from graph_exec.kernels.grad_buffers import make_host_accumulate

    count = len(buffers)

    def eager(grads: tuple) -> None:
        for buffer, grad in zip(buffers, grads, strict=True):
            ops.assign_add(buffer, grad)

    def add_passed(*args: Any) -> None:
        for index in range(count):
            ops.assign_add(args[index], args[count + index])

    def add_held(*grads: Any) -> None:
        for index in range(count):
            for micro in range(MICRO):  # each buffer in micro-batch order: the eager floats
                ops.assign_add(buffers[index], grads[micro * count + index])

    host_add = make_host_accumulate(buffers)  # what the executors use on CPU

    def numpy_views(grads: tuple) -> None:  # the executors' previous CPU adder
        _pynative_executor.sync()
        for buffer, grad in zip(buffers, grads, strict=True):
            view = buffer.asnumpy()
            np.add(view, grad.asnumpy(), out=view)

    jit_closed = ms.jit(make_accumulate(buffers))
    jit_passed = ms.jit(add_passed)
    jit_held = ms.jit(add_held)
    held: list[Any] = []

    def batched(grads: tuple) -> None:
        held.extend(grads)
        if len(held) == MICRO * count:
            jit_held(*held)
            held.clear()

    return {
        "eager assign_add per parameter": eager,
        "numpy add through asnumpy() views": numpy_views,
        "C++ add by address (CPU; executors)": lambda grads: host_add(*grads),
        "one jitted add, buffers closed over": lambda grads: jit_closed(*grads),
        "one jitted add, buffers as arguments": lambda grads: jit_passed(*buffers, *grads),
        f"one jitted add per {MICRO} micro-batches": batched,
        "no accumulation (floor)": lambda grads: None,
    }


def _last_stage(name: str, prefix: str) -> tuple[Any, Callable[..., Any], Any, Any]:
    """A last chunk, its loss function, an input and labels: ``"lm"`` is the example LM's last
    chunk (3 blocks, head, cross-entropy; batch 2x32, width 64); ``"dense32"`` is 8x(Dense+Tanh)
    32 wide on 4 rows with a 16-class head and cross-entropy."""
    from mindspore import Tensor, nn, ops

    from graph_exec.examples.lm import LMChunk, LMConfig, lm_cross_entropy

    rng = np.random.default_rng(2)
    if name == "lm":
        config = LMConfig(vocab=128, width=64, heads=4, layers=3, seq=32)
        cell, loss_fn = LMChunk(config, 3, embedding=False, head=True), lm_cross_entropy
        x = Tensor(rng.standard_normal((2, 32, 64), dtype=np.float32))
        y = Tensor(rng.integers(0, config.vocab, (2, 32), dtype=np.int32))
    else:
        layers = [nn.SequentialCell([nn.Dense(32, 32), nn.Tanh()]) for _ in range(8)]
        cell = nn.SequentialCell([*layers, nn.Dense(32, 16)])

        def loss_fn(logits: Any, labels: Any) -> Any:
            return ops.cross_entropy(logits, labels)

        x = Tensor(rng.standard_normal((4, 32), dtype=np.float32))
        y = Tensor(rng.integers(0, 16, (4,), dtype=np.int32))
    cell.update_parameters_name(prefix)
    return cell, loss_fn, x, y


def last_stage_fused_vs_tape(name: str, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """One last-stage micro-batch (forward, loss scaled by 1/4, backward, accumulation)."""
    from graph_exec.executors import create_executor

    fused_cell, loss_fn, hidden, labels = _last_stage(name, "fused.")
    fused = _fused_in_graph_add(fused_cell, loss_fn)
    fused_then_add = _fused_returning_then_add(name, loss_fn, hidden, labels)
    executor_cell = _last_stage(name, "executor.")[0]
    executor = create_executor("graph", {2: executor_cell}, loss_fn=loss_fn, loss_scale=0.25)
    taped_then_add = _taped_then_host_add(name, loss_fn, hidden, labels)
    cases = {
        "fused jit, in-graph assign_add": _timed_call(lambda: fused(hidden, labels)),
        "fused jit returning grads, eager add": _timed_call(fused_then_add),
        "taped loss + bprop, host adds": _timed_call(taped_then_add),
        "executor (one graph, host adds)": _timed_call(
            lambda: executor.last_stage_step(2, 0, (hidden,), (labels,))
        ),
    }
    samples = _interleaved(cases, rounds, warmup)
    return _print_table(
        f"last stage {name}, graph mode, one micro-batch", samples, "fused jit, in-graph assign_add"
    )


def _timed_call(step: Callable[[], Any]) -> Callable[[], float]:
    """A sample of ``step``: its seconds until its results are computed."""

    def run() -> float:
        start = time.perf_counter()
        _sync(step())
        return time.perf_counter() - start

    return run


def _fused_in_graph_add(fused_cell: Any, loss_fn: Any) -> Callable[..., Any]:
    """One jitted graph: forward, scaled loss, backward and the weight gradients' ``assign_add``."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, ops

    fused_params = ParameterTuple(fused_cell.trainable_params())
    fused_buffers = ParameterTuple(
        [Parameter(ops.zeros_like(p), name="facc." + p.name, requires_grad=False) for p in fused_params]
    )

    def fused_step(x: Any, y: Any) -> Any:
        def scaled(x: Any, y: Any) -> Any:
            loss = loss_fn(fused_cell(x), y)
            return loss * 0.25, loss

        (_, loss), (dx, dws) = ms.value_and_grad(scaled, 0, fused_params, has_aux=True)(x, y)
        for index in range(len(fused_buffers)):
            ops.assign_add(fused_buffers[index], dws[index])
        return loss, dx

    return ms.jit(fused_step)


def _fused_returning_then_add(name: str, loss_fn: Any, hidden: Any, labels: Any) -> Callable[[], Any]:
    """A jitted graph that returns the weight gradients, then a jitted add into buffers."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, ops

    from graph_exec.kernels import make_accumulate

    returning_cell = _last_stage(name, "returning.")[0]
    returning_params = ParameterTuple(returning_cell.trainable_params())

    def returning_step(x: Any, y: Any) -> Any:
        def scaled(x: Any, y: Any) -> Any:
            return loss_fn(returning_cell(x), y) * 0.25

        loss, (dx, dws) = ms.value_and_grad(scaled, grad_position=0, weights=returning_params)(x, y)
        return loss, dx, dws

    returning = ms.jit(returning_step)
    returning_buffers = [
        Parameter(ops.zeros_like(p), name="racc." + p.name, requires_grad=False) for p in returning_params
    ]
    returning_add = make_accumulate(ParameterTuple(returning_buffers))

    def fused_then_add() -> Any:
        loss, dx, dws = returning(hidden, labels)
        returning_add(*dws)
        return [loss, dx, *returning_buffers]

    return fused_then_add


def _taped_then_host_add(name: str, loss_fn: Any, hidden: Any, labels: Any) -> Callable[[], Any]:
    """The taped loss and its bprop, the weight gradients added on the host."""
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, ops

    from graph_exec.executors.tape import Tape
    from graph_exec.kernels import make_stage_loss
    from graph_exec.kernels.grad_buffers import make_host_accumulate

    taped_cell = _last_stage(name, "taped.")[0]
    taped_params = ParameterTuple(taped_cell.trainable_params())
    tape = Tape(make_stage_loss(taped_cell, 1, loss_fn), taped_params, True, ms.jit)
    taped_add = make_host_accumulate(
        [Parameter(ops.zeros_like(p), name="tacc." + p.name, requires_grad=False) for p in taped_params]
    )
    scale = ops.full((), 0.25, dtype=ms.float32)

    def taped_then_add() -> Any:
        loss = tape(hidden, labels)
        (dx, _), dws = tape.backward((hidden, labels), scale)
        taped_add(*dws)
        return [loss, dx]

    return taped_then_add


def slow_mode_candidates(rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """What the old compiled recompute-backward's outputs cost: one dense32 backward per sample.

    The same jitted recompute ``value_and_grad`` returning the input gradient only; returning
    the weight gradients too; adding them into accumulator Parameters inside the graph; and
    the taped bprop for comparison (forward recorded just before, not timed). Its random slow
    mode came from MindSpore's host pipeline threads, which ``MS_DEV_HOST_BLOCKING_RUN=1`` (set
    by ``prepare_mindspore`` on CPU) turns off: run this with the variable at 0 to look for it.
    """
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, ops

    from graph_exec.executors.tape import Tape
    from graph_exec.kernels import make_stage_forward

    cell, shape = build_chunk("dense32")
    params = ParameterTuple(cell.trainable_params())
    buffers = ParameterTuple(
        [Parameter(ops.zeros_like(p), name="slow." + p.name, requires_grad=False) for p in params]
    )

    def objective(x: Any, c: Any) -> Any:
        return (cell(x) * c).sum()

    inputs_only = ms.value_and_grad(objective, grad_position=0)
    with_weights = ms.value_and_grad(objective, grad_position=0, weights=params)

    def input_grad(x: Any, c: Any) -> Any:
        return inputs_only(x, c)[1]

    def all_grads(x: Any, c: Any) -> Any:
        return with_weights(x, c)[1]

    def written(x: Any, c: Any) -> Any:
        dx, dws = with_weights(x, c)[1]
        for index in range(len(buffers)):
            ops.assign_add(buffers[index], dws[index])
        return dx

    tape = Tape(make_stage_forward(cell), params, True, ms.jit)
    rng = np.random.default_rng(4)
    jitted = {
        "jit: input grad only": ms.jit(input_grad),
        "jit: + 16 weight grads returned": ms.jit(all_grads),
        "jit: + in-graph assign_add": ms.jit(written),
    }

    def case(label: str) -> Callable[[], float]:
        def run() -> float:
            x = Tensor(rng.standard_normal(shape, dtype=np.float32))
            c = Tensor(rng.standard_normal(shape, dtype=np.float32))
            if label == "taped bprop":
                tape(x)
                start = time.perf_counter()
                _sync(tape.backward((x,), (c,)))
            else:
                start = time.perf_counter()
                _sync(jitted[label](x, c))
            return time.perf_counter() - start

        return run

    labels = [*jitted, "taped bprop"]
    samples = _interleaved({label: case(label) for label in labels}, rounds, warmup)
    return _print_table("slow-mode candidates, one dense32 backward", samples, "jit: input grad only")


def recompute_backward(rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """One recompute backward per sample (a forward that kept only its inputs), graph mode.

    ``Tape.recompute`` (forward and gradient in one compiled graph, what the executors run)
    against recording the jitted forward under the tape and running its bprop (what they ran
    before), on the ``embed_lm`` tiny preprocess (embedding and one block, 2x32 tokens, weight
    gradients only) and on the dense32 chunk (input and weight gradients), each once idle and
    once while two taped forwards of another chunk are in flight, as in a pipeline step. The
    two give the same gradients bit for bit (checked here on the first sample).
    """
    import mindspore as ms
    from mindspore import ParameterTuple, Tensor

    from graph_exec.executors.tape import Tape
    from graph_exec.kernels import make_stage_forward

    rng = np.random.default_rng(5)
    subjects = _recompute_subjects(rng)
    summary = {}
    for in_flight in (False, True):
        other, other_shape = build_chunk("dense32")
        kept = Tape(make_stage_forward(other), ParameterTuple(other.trainable_params()), True, ms.jit)
        held = [(Tensor(rng.standard_normal(other_shape, dtype=np.float32)),) for _ in range(2)]
        if in_flight:
            for args in held:
                _sync(kept(*args))
        for name, subject in subjects.items():
            cases = {
                "tape: record + bprop": _gradient_case(_taped_gradient, name, subject, rng),
                "Tape.recompute (one graph)": _gradient_case(_one_go_gradient, name, subject, rng),
            }
            samples = _interleaved(cases, rounds, warmup)
            where = "two taped forwards in flight" if in_flight else "idle"
            summary[f"{name}, {where}"] = _print_table(
                f"recompute backward, {name}, {where}", samples, "tape: record + bprop"
            )
        if in_flight:
            for args in held:
                _sync(kept.backward(args, (ms.ops.zeros(other_shape, ms.float32),)))
    return summary


def _recompute_subjects(
    rng: np.random.Generator,
) -> dict[str, tuple[Any, Callable[[], tuple], tuple[int, ...]]]:
    """``name -> (jitted tape, a fresh sample's inputs, output shape)`` of what
    :func:`recompute_backward` differentiates: the ``embed_lm`` tiny preprocess and dense32."""
    import mindspore as ms
    from mindspore import ParameterTuple, Tensor

    from graph_exec.examples.embed_lm import EmbeddingAndBlock
    from graph_exec.examples.lm import LMConfig
    from graph_exec.executors.tape import Tape
    from graph_exec.kernels import make_preprocess_forward, make_stage_forward

    preprocess = EmbeddingAndBlock(LMConfig(vocab=128, width=32, heads=4, layers=2, seq=32))
    preprocess.update_parameters_name("rc_pre.")
    dense, dense_shape = build_chunk("dense32")
    return {
        "embed_lm preprocess": (
            Tape(
                make_preprocess_forward(preprocess, 1, (), {}),
                ParameterTuple(preprocess.trainable_params()),
                False,
                ms.jit,
            ),
            lambda: (Tensor(rng.integers(0, 128, (2, 32), dtype=np.int32)),),
            (2, 32, 32),
        ),
        "dense32": (
            Tape(make_stage_forward(dense), ParameterTuple(dense.trainable_params()), True, ms.jit),
            lambda: (Tensor(rng.standard_normal(dense_shape, dtype=np.float32)),),
            dense_shape,
        ),
    }


def _gradient_case(
    differentiate: Callable[..., Any], name: str, subject: tuple, rng: np.random.Generator
) -> Callable[[], float]:
    """One timed sample of ``differentiate`` on ``subject`` (fresh inputs and sensitivities);
    the one-go way's first sample is checked against the taped way's gradients, bit for bit."""
    from mindspore import Tensor

    tape, make_args, out_shape = subject
    checked: list[bool] = []

    def run() -> float:
        args = make_args()
        sens = (Tensor(rng.standard_normal(out_shape, dtype=np.float32)),)
        start = time.perf_counter()
        grads = differentiate(tape, args, sens)
        _sync(grads)
        elapsed = time.perf_counter() - start
        if differentiate is _one_go_gradient and not checked:  # same gradients both ways
            checked.append(True)
            _require_equal(name, grads, _taped_gradient(tape, args, sens))
        return elapsed

    return run


def _taped_gradient(tape: Any, args: tuple, sens: tuple) -> tuple:
    tape(*args)
    return tape.backward(args, sens)


def _one_go_gradient(tape: Any, args: tuple, sens: tuple) -> tuple:
    return tape.recompute(args, sens)


def _require_equal(name: str, got: tuple, want: tuple) -> None:
    """Raise unless two ``(input grads, weight grads)`` pairs are equal bit for bit."""
    for left, right in zip((*got[0], *got[1]), (*want[0], *want[1]), strict=True):
        if not np.array_equal(left.asnumpy(), right.asnumpy()):
            raise AssertionError(f"{name}: the two ways of differentiating give different gradients")


def memory_probe(mode: str, recompute: bool, in_flight: int) -> float:
    """Resident bytes gained per in-flight LM-stage micro-batch (3 blocks, width 64, 2×32).

    Call in a fresh process. One forward+backward first (compiles, and sizes the allocator for
    one micro-batch); then ``in_flight`` forwards are held and the resident set measured.
    """
    from mindspore import Tensor

    from graph_exec.examples.lm import LMChunk, LMConfig
    from graph_exec.executors import create_executor

    config = LMConfig(vocab=128, width=64, heads=4, layers=3, seq=32)
    body = LMChunk(config, 3, embedding=False, head=False)
    body.update_parameters_name("mem.")
    executor = create_executor(mode, {1: body}, recompute=recompute)
    rng = np.random.default_rng(3)
    xs = [Tensor(rng.standard_normal((2, 32, 64), dtype=np.float32)) for _ in range(in_flight + 1)]
    cotangent = Tensor(rng.standard_normal((2, 32, 64), dtype=np.float32))
    executor.stage_forward(1, -1, (xs[-1],))
    executor.stage_backward(1, -1, (cotangent,))
    before = _resident_bytes()
    outputs = [executor.stage_forward(1, m, (xs[m],)) for m in range(in_flight)]
    _sync(outputs)
    held = _resident_bytes() - before
    del outputs
    executor.drop_kept()
    return held / in_flight


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_in_fresh_process(flag: str, *values: str) -> Any:
    """Run one measurement of this module in a new Python process; returns its JSON result."""
    command = [sys.executable, "-m", "graph_exec.benchmarks.executor_speed", flag, *values]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_per_micro(in_flight: int) -> dict[str, float]:
    """Bytes held per in-flight micro-batch, each variant in its own fresh process."""
    input_bytes = 2 * 32 * 64 * 4
    print(
        f"\n== LM stage (3 blocks, width 64, batch 2x32): resident KiB per in-flight micro-batch, "
        f"{in_flight} in flight (its input alone: {input_bytes / 1024:.0f} KiB) =="
    )
    result = {}
    for mode in ("graph", "pynative"):
        for recompute in (False, True):
            held = measure_in_fresh_process("--memory-probe", mode, str(recompute), str(in_flight))
            label = f"{mode} {'recompute=True' if recompute else 'tape (default)'}"
            result[label] = held
            print(f"{label:34s}{held / 1024:10.1f}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunks", default=",".join(CHUNKS), help=f"comma-separated, from {','.join(CHUNKS)}"
    )
    parser.add_argument("--runs", type=int, default=1, help="separate processes for the chunk measurements")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=32, help="micro-batches held for the memory probe")
    parser.add_argument(
        "--only", choices=("chunks", "accumulation", "last", "slow", "recompute", "memory"), default=None
    )
    parser.add_argument("--memory-probe", nargs=3, metavar=("MODE", "RECOMPUTE", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chunks = [c for c in args.chunks.split(",") if c]
    _setup()
    if args.memory_probe:
        mode, recompute, count = args.memory_probe
        print(json.dumps(memory_probe(mode, recompute == "True", int(count))))
        return 0
    if args.chunk_run:
        print(json.dumps({c: chunk_speed(c, args.rounds, args.warmup) for c in chunks}))
        return 0
    print(f"executor speed: {args.rounds} rounds after {args.warmup} warm-up rounds, cases interleaved")
    if args.only in (None, "chunks"):
        if args.runs == 1:
            for chunk in chunks:
                chunk_speed(chunk, args.rounds, args.warmup)
        else:
            _chunk_runs(chunks, args)
    if args.only in (None, "accumulation"):
        for chunk in chunks:
            accumulation_candidates(chunk, args.rounds * 2, args.warmup)
    if args.only in (None, "last"):
        for name in ("lm", "dense32"):
            last_stage_fused_vs_tape(name, args.rounds, args.warmup)
    if args.only in (None, "slow"):
        slow_mode_candidates(args.rounds * 4, args.warmup)
    if args.only in (None, "recompute"):
        recompute_backward(args.rounds * 3, args.warmup)
    if args.only in (None, "memory"):
        memory_per_micro(args.in_flight)
    return 0


def _chunk_runs(chunks: list[str], args: argparse.Namespace) -> None:
    """:func:`chunk_speed` in ``args.runs`` fresh processes: per run, p50, p90/p50 and the
    speed-up over the eager tape reference (its p50 / the case's p50)."""
    flags = [
        "--chunk-run",
        "--chunks",
        ",".join(chunks),
        "--rounds",
        str(args.rounds),
        "--warmup",
        str(args.warmup),
    ]
    runs = [measure_in_fresh_process(*flags) for _ in range(args.runs)]
    reference = "eager tape (reference)"
    for chunk in chunks:
        print(f"\n== {chunk}: p50 ms (p90/p50) speed-up, in each of {args.runs} separate processes ==")
        for case in runs[0][chunk]:
            cells = []
            for run in runs:
                spread, ref_p50 = run[chunk][case], run[chunk][reference]["p50"]
                cells.append(
                    f"{spread['p50']:.1f} ({spread['p90'] / spread['p50']:.2f}) {ref_p50 / spread['p50']:.2f}x"
                )
            print(f"{case:24s}" + "".join(f"{c:>23s}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
