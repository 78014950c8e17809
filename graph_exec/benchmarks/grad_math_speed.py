"""What the end of a step's arithmetic over the gradient accumulators costs, per call, by how it
is done on CPU.

``python -m graph_exec.benchmarks.grad_math_speed [example] [size] [--calls N] [--runs R]``
(default ``embed_lm small``, 200 calls, three runs) takes the accumulators one rank holds in
the ``training_loop_speed`` job (2 ranks, ``V = 2``: stages 0 and 2 and the preprocess of a
4-stage model), in one process bound to one core, and times three ways of each operation the
end of a step does with a loss scaler, clipping and ``step()``:

- ``compiled``: the kernels of :mod:`graph_exec.kernels.grad_ops` under ``mindspore.jit`` (the
  device path);
- ``numpy views``: numpy on ``asnumpy()`` views of each accumulator, what a user would write on
  the host (multiply in place, ``isfinite``, ``vdot`` for the share);
- ``host C++``: :class:`~graph_exec.kernels.grad_ops.HostGradients`, by address (the CPU fast
  path).

Operations: ``unscale+check+share`` (multiply by ``1/scale``, every value finite, the 2-norm's
share), ``scale`` (the clip), ``zero`` (``zero_grad``). The candidates run in turns, call by
call, so that machine noise hits them alike; every run prints p10/p50/p90 in ms of each, and
the p50 ratio of each candidate to ``host C++``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

from graph_exec.benchmarks.common import argument_parser, p10_p50_p90

#: The stages a rank of the 2-rank, V = 2 training_loop_speed job holds, with the preprocess.
RANK_STAGES, NUM_STAGES = (0, 2), 4
FACTOR = 2.0**-16


def _candidates(buffers) -> dict[str, dict[str, Callable[[], object]]]:
    """``{operation: {candidate: call}}`` over ``buffers``."""
    import mindspore as ms
    import numpy as np
    from mindspore import ParameterTuple, Tensor

    from graph_exec.device import wait_until_run
    from graph_exec.kernels import (
        HostGradients,
        make_multiply_grads,
        make_unscale_and_check,
        make_zero_grads,
    )

    tuple_ = ParameterTuple(buffers)
    everyone = tuple(range(len(buffers)))
    factor = Tensor(FACTOR, ms.float32)
    check = ms.jit(make_unscale_and_check(tuple_, everyone, 2.0))
    scale = ms.jit(make_multiply_grads(tuple_))
    zero = ms.jit(make_zero_grads(tuple_))
    host = HostGradients(buffers)

    def views() -> list:
        wait_until_run()
        return [buffer.asnumpy() for buffer in buffers]

    def numpy_check() -> tuple[bool, float]:
        arrays = views()
        for array in arrays:
            np.multiply(array, np.float32(FACTOR), out=array)
        finite = all(np.isfinite(array).all() for array in arrays)
        return finite, sum(float(np.vdot(array, array)) for array in arrays)

    def numpy_scale() -> None:
        for array in views():
            np.multiply(array, np.float32(FACTOR), out=array)

    def numpy_zero() -> None:
        for array in views():
            array[...] = 0

    return {
        "unscale+check+share": {
            "compiled": lambda: check(factor).asnumpy(),
            "numpy views": numpy_check,
            "host C++": lambda: host.unscale_and_check(FACTOR, everyone, 2.0),
        },
        "scale": {
            "compiled": lambda: (scale(factor), wait_until_run()),
            "numpy views": numpy_scale,
            "host C++": lambda: host.multiply(FACTOR),
        },
        "zero": {
            "compiled": lambda: (zero(), wait_until_run()),
            "numpy views": numpy_zero,
            "host C++": host.zero,
        },
    }


def _worker(example: str, size: str, calls: int) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # as a rank is bound
    from graph_exec.examples import load
    from graph_exec.kernels import make_buffer
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    family = load(example)
    model = family.build(NUM_STAGES, trainable_preprocess=True, size=size)
    params = [p for s in RANK_STAGES for p in model.stages[s].trainable_params()]
    params += list(model.preprocess.trainable_params())
    buffers = [make_buffer(p) for p in params]
    print(f"{len(buffers)} accumulators, {sum(b.size for b in buffers)} values", flush=True)
    for operation, candidates in _candidates(buffers).items():
        for call in candidates.values():  # compile, warm up
            call()
        seconds: dict[str, list[float]] = defaultdict(list)
        for _ in range(calls):
            for name, call in candidates.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        host = statistics.median(seconds["host C++"])
        print(
            f"  {operation:<20} "
            + "  ".join(
                f"{name} {'/'.join(f'{v * 1e3:.3f}' for v in p10_p50_p90(s))} ms "
                f"({statistics.median(s) / host:.1f}x)"
                for name, s in seconds.items()
            ),
            flush=True,
        )


def main(argv: list[str]) -> int:
    from graph_exec.examples import EXAMPLES

    parser = argument_parser(__doc__, "grad_math_speed")
    parser.add_argument("example", nargs="?", choices=tuple(EXAMPLES), default="embed_lm")
    parser.add_argument("size", nargs="?", choices=("tiny", "small"), default="small")
    parser.add_argument("--calls", type=int, default=200, help="calls of each candidate (default 200)")
    parser.add_argument("--runs", type=int, default=3, help="processes, each measured on its own (default 3)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.runs < 1:
        parser.error(f"--calls and --runs must be at least 1, got {args.calls} and {args.runs}")
    for run in range(1, args.runs + 1):
        print(
            f"run {run}/{args.runs}: {args.example} {args.size}, one rank's accumulators, "
            f"p10/p50/p90 of {args.calls} calls (x: p50 over host C++'s):",
            flush=True,
        )
        command = [sys.executable, __file__, "worker", args.example, args.size, str(args.calls)]
        result = subprocess.run(command, check=False, timeout=1800)
        if result.returncode:
            return result.returncode
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main(sys.argv[1:]))
