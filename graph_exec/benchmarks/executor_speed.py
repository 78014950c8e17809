"""Graph vs pynative executor speed on one stage of the example LM.

Measures, in one process and side by side (the two executors alternate every repeat, so machine
noise hits both alike):

* stage forward and stage backward time per call, graph vs pynative, and their ratio;
* compile seconds of each graph kernel (first call of a signature);
* on the last stage: the fused ``last_stage_step`` against a separate forward, loss gradient
  and backward;
* how the graph backward accumulates weight gradients: in the graph with ``ops.assign_add``
  (what the kernels do) against returning the gradients and adding them in Python.

Run ``python -m graph_exec.benchmarks.executor_speed [--width 64 --blocks 3 ...]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _sync(value: Any) -> None:
    """Wait for every tensor in ``value`` (``asnumpy`` is the reliable barrier on CPU).

    Last entries first: a jitted call returns before its graph has run, and waiting first on a
    tensor the graph produces early (the loss of a fused step) was measured 3-5x slower per
    call than waiting on the input gradients, which the graph produces last.
    """
    if isinstance(value, tuple | list):
        for item in reversed(value):
            _sync(item)
    elif value is not None:
        value.asnumpy()


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    _sync(fn())
    return time.perf_counter() - start


def _alternate(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median milliseconds per case, the cases interleaved repeat by repeat."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: _median_ms(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=3, help="transformer blocks in the stage")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per accumulation round")
    args = parser.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor, ops

    from graph_exec.examples.lm import LMChunk, LMConfig, lm_cross_entropy
    from graph_exec.executors import create_executor
    from graph_exec.kernels import (
        BackwardLayout,
        GradBuffers,
        make_buffer,
        make_stage_backward,
        value_and_grads,
    )
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    ms.set_seed(0)
    config = LMConfig(vocab=args.vocab, width=args.width, heads=args.heads, layers=args.blocks, seq=args.seq)
    rng = np.random.default_rng(0)
    hidden = Tensor(rng.standard_normal((args.batch, args.seq, args.width), dtype=np.float32))
    cotangent = Tensor(rng.standard_normal((args.batch, args.seq, args.width), dtype=np.float32))
    labels = Tensor(rng.integers(0, args.vocab, (args.batch, args.seq), dtype=np.int32))

    body = LMChunk(config, args.blocks, embedding=False, head=False)
    body.update_parameters_name("body.")
    n_params = sum(int(np.prod(p.shape)) for p in body.trainable_params())
    print(
        f"stage: {args.blocks} blocks, width {args.width}, heads {args.heads}, seq {args.seq}, "
        f"batch {args.batch}, {n_params / 1e6:.2f} M parameters; medians of {args.repeats} "
        f"repeats after {args.warmup} warm-up calls, graph and pynative interleaved"
    )

    executors = {mode: create_executor(mode, {1: body}) for mode in ("graph", "pynative")}
    graph = executors["graph"]

    def forward(mode: str) -> float:
        executor = executors[mode]
        elapsed = _timed(lambda: executor.stage_forward(1, 0, (hidden,)))
        executor.drop_kept()
        return elapsed

    def backward(mode: str) -> float:
        executor = executors[mode]
        executor.stage_forward(1, 0, (hidden,))
        return _timed(lambda: executor.stage_backward(1, 0, (cotangent,)))

    compile_s = {}
    for kind, run in (("forward", forward), ("backward", backward)):
        before = graph.compile_stats.compile_seconds
        run("graph")
        compile_s[kind] = graph.compile_stats.compile_seconds - before
    for _ in range(args.warmup):
        for mode in executors:
            forward(mode)
            backward(mode)
    fwd = _alternate({mode: lambda m=mode: forward(m) for mode in executors}, args.repeats)
    bwd = _alternate({mode: lambda m=mode: backward(m) for mode in executors}, args.repeats)

    print("\n== body stage, per call (ms) ==")
    print(f"{'':10s}{'graph':>10s}{'pynative':>10s}{'pyn/graph':>11s}{'compile s':>11s}")
    for name, times in (("forward", fwd), ("backward", bwd)):
        ratio = times["pynative"] / times["graph"]
        print(
            f"{name:10s}{times['graph']:10.2f}{times['pynative']:10.2f}{ratio:10.2f}x{compile_s[name]:11.2f}"
        )

    # -- weight-gradient accumulation: in the graph, or returned and added in Python ----------
    # A step runs M micro-batch backwards, sends each one's input gradient on (so it is waited
    # for every call) and reads the accumulated weight gradients once at the end.
    params = body.trainable_params()
    grads = GradBuffers(params, [make_buffer(p) for p in params])
    in_graph = ms.jit(make_stage_backward(body, grads, BackwardLayout(1, (0,), (0,))))

    def objective(x: Tensor, c: Tensor) -> Tensor:
        return (body(x) * c).sum()

    differentiate = value_and_grads(objective, (0,), grads.params)

    def returns_grads(x: Tensor, c: Tensor) -> tuple:
        _, input_grads, weight_grads = differentiate(x, c)
        return input_grads, weight_grads

    returning = ms.jit(returns_grads)

    def accumulate_in_graph() -> float:
        def step() -> list:
            for _ in range(args.micro):
                _sync(in_graph(hidden, cotangent))
            return list(grads.buffers)

        return _timed(step) / args.micro

    def accumulate_in_python() -> float:
        def step() -> list:
            acc = [ops.zeros_like(p) for p in params]
            for _ in range(args.micro):
                input_grads, weight_grads = returning(hidden, cotangent)
                _sync(input_grads)
                acc = [a + g for a, g in zip(acc, weight_grads, strict=True)]
            return acc

        return _timed(step) / args.micro

    def no_accumulation() -> float:
        def step() -> None:
            for _ in range(args.micro):
                _sync(returning(hidden, cotangent)[0])

        return _timed(step) / args.micro

    cases = {
        "in-graph assign_add": accumulate_in_graph,
        "returned + Python add": accumulate_in_python,
        "returned, not added": no_accumulation,
    }
    for _ in range(args.warmup):
        for case in cases.values():
            case()
    acc = _alternate(cases, max(1, args.repeats // args.micro))
    print(f"\n== graph backward, weight-gradient accumulation, per micro-batch of {args.micro} (ms) ==")
    for name, value in acc.items():
        print(f"{name:24s}{value:10.2f}")

    # -- last stage: fused step vs forward + loss gradient + backward ------------------------
    last = LMChunk(config, args.blocks, embedding=False, head=True)
    last.update_parameters_name("last.")
    last_graph = create_executor("graph", {2: last}, loss_fn=lm_cross_entropy)

    def loss_and_cotangent(logits: Tensor, y: Tensor) -> tuple:
        return ms.value_and_grad(lm_cross_entropy, grad_position=0)(logits, y)

    loss_grad = ms.jit(loss_and_cotangent)

    def fused() -> float:
        return _timed(lambda: last_graph.last_stage_step(2, 0, (hidden,), (labels,)))

    def separate() -> float:
        def step() -> Any:
            (logits,) = last_graph.stage_forward(2, 0, (hidden,))
            loss, d_logits = loss_grad(logits, labels)
            return loss, last_graph.stage_backward(2, 0, (d_logits,))

        return _timed(step)

    before = last_graph.compile_stats.compile_seconds
    fused()
    fused_compile = last_graph.compile_stats.compile_seconds - before
    before = last_graph.compile_stats.compile_seconds
    separate()
    separate_compile = last_graph.compile_stats.compile_seconds - before
    for _ in range(args.warmup):
        fused()
        separate()
    steps = _alternate({"fused": fused, "separate": separate}, args.repeats)
    print("\n== last stage (blocks + head + cross-entropy), graph mode (ms) ==")
    print(f"fused last_stage_step     {steps['fused']:10.2f}   compile {fused_compile:.2f} s")
    print(
        f"forward + loss + backward {steps['separate']:10.2f}   compile {separate_compile:.2f} s "
        "(2 graphs; the loss-gradient graph not counted)"
    )
    print(f"fused speed-up            {steps['separate'] / steps['fused']:10.2f}x")
    stats = graph.compile_stats
    print(f"\nbody graph executor: {stats.compilations} compilations, {stats.compile_seconds:.2f} s in total")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
