"""Measure what a decoder layer's tape keeps, and fit :data:`graph_exec.config_sizes.TAPE_COEFFICIENTS`.

A tape is measured as the issue asks: memory in use (:func:`graph_exec.device.memory_in_use`:
the allocator where the device keeps one, else RSS) grown by :data:`KEPT` forwards of a stage
held under the tape for their backward, minus what the same forwards grow it by without the tape
(their outputs, held the same way), per forward and per layer. The stage is the middle one of a
small Qwen2 (``mindone``) cut into three, so that it is decoder layers alone.

``python -m graph_exec.harness.tape_fit`` measures the grid in :data:`GRID` and prints the
least-squares coefficients of ``tape = e·b·s·(A·h + C·i + D·heads·s)`` with each point's
measured and fitted bytes (docs/memory.md).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from graph_exec.config_sizes import ModelShape, layer_tape_bytes

RESULT = "@@tape "
#: Forwards held at once per measurement.
KEPT = 4
#: ``(hidden, intermediate, seq)`` points of the fit (heads = hidden / 32, rows 2): widths,
#: MLP ratios and lengths varied apart, so that A, C and D are each determined.
GRID = ((128, 256, 128), (256, 512, 128), (128, 256, 256), (128, 768, 128), (256, 1024, 256))


@dataclass(frozen=True)
class TapePoint:
    hidden: int
    intermediate: int
    heads: int
    seq: int
    rows: int
    layers: int
    measured: float  #: bytes per layer per micro-batch

    def shape(self) -> ModelShape:
        return small_shape(self.hidden, self.intermediate, self.heads)


def small_shape(hidden: int, intermediate: int, heads: int) -> ModelShape:
    """The :class:`ModelShape` of the small Qwen2 :func:`measure` builds."""
    return ModelShape(
        "qwen2",
        hidden,
        intermediate,
        4,
        heads,
        max(heads // 2, 1),
        hidden // heads,
        64,
        False,
        True,
        False,
        False,
    )


def measure(
    hidden: int,
    seq: int,
    rows: int = 2,
    layers: int = 2,
    intermediate: int = 0,
    heads: int = 0,
    keep: list[Any] | None = None,
) -> TapePoint:
    """One layer's tape for a micro-batch of ``rows × seq`` tokens (float32, eager attention).
    ``keep``: append the held forwards there instead of releasing them (:func:`measure_together`)."""
    import mindspore as ms
    import numpy as np
    from transformers import Qwen2Config

    import graph_exec.models as gm
    from graph_exec.executors.graph import GraphExecutor

    intermediate, heads = intermediate or 2 * hidden, heads or max(hidden // 32, 1)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers + 2,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    ms.set_seed(0)
    split = gm.split_model(gm.mindone().Qwen2ForCausalLM(config), 3, layers=(1, layers, 1), preprocess="none")
    executor = GraphExecutor(
        dict(enumerate(split.stages)), loss_fn=gm.causal_lm_loss, last_stage=2, first_stage_input_grads=False
    )
    ids, positions = gm.lm_inputs(np.arange(rows * seq).reshape(rows, seq) % 64)
    hidden_in = split.stages[0](ms.Tensor(ids), ms.Tensor(positions))
    taped = _grown(lambda k: executor.stage_forward(1, k, hidden_in), executor, hidden_in, keep)
    plain = _grown(lambda k: split.stages[1](*hidden_in), None, hidden_in, keep)
    return TapePoint(hidden, intermediate, heads, seq, rows, layers, (taped - plain) / layers)


def _grown(forward: Any, executor: Any, inputs: tuple[Any, ...], keep: list[Any] | None = None) -> float:
    """Growth of memory in use per held forward: the median step from the second held forward
    on, so that memory the allocator had already freed and reuses for the first one does not
    count (``executor``: release the tapes after, unless ``keep`` takes them)."""
    from mindspore import ops

    from graph_exec.device import memory_in_use, wait_for

    base = 10**8
    held, seen = [], []
    for k in range(KEPT + 2):
        held.append(forward(base + k))
        wait_for(held[-1])
        seen.append(memory_in_use())
    if keep is not None:
        keep.append((executor, held))
    elif executor is not None:
        cotangents = tuple(ops.ones_like(o) if o.dtype == inputs[0].dtype else None for o in held[0])
        for k in range(KEPT + 2):
            executor.stage_backward(1, base + k, cotangents)
    return float(statistics.median(b - a for a, b in itertools.pairwise(seen[1:])))


def fit(points: list[TapePoint]) -> tuple[float, float, float]:
    """Least-squares ``(A, C, D)`` of ``measured = 4·b·s·(A·h + C·i + D·heads·s)`` (float32)."""
    import numpy as np

    rows = [[4 * p.rows * p.seq * x for x in (p.hidden, p.intermediate, p.heads * p.seq)] for p in points]
    solution, *_ = np.linalg.lstsq(np.array(rows, float), np.array([p.measured for p in points]), rcond=None)
    return tuple(float(x) for x in solution)


def measure_together(points: list[tuple[int, int, int]], rows: int = 2) -> list[TapePoint]:
    """:func:`measure` of each ``(hidden, intermediate, seq)`` in one fresh process, one after
    the other, every measured forward held until all are measured: MindSpore's pool keeps freed
    memory and would reuse it for the next point's tapes, but nothing a point measured is freed
    (only a forward's temporaries, which the first two held forwards of the next point, left
    out of the median, take). One import of MindSpore and mindone for all points: the cheap
    way (tests/runtime/test_tape_formula.py); :func:`measure_apart` is the clean one."""
    return _run_points(["--together", *(f"{h},{i},{s}" for h, i, s in points), f"--rows={rows}"])


def _run_points(argv: list[str]) -> list[TapePoint]:
    """The points a ``python -m graph_exec.harness.tape_fit argv`` process prints."""
    import json
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "graph_exec.harness.tape_fit", *argv], stdout=subprocess.PIPE, text=True
    )
    if run.returncode:
        raise RuntimeError(f"a tape measurement failed (exit {run.returncode}): {run.args}")
    lines = [x for x in run.stdout.splitlines() if x.startswith(RESULT)]
    return [TapePoint(**json.loads(line[len(RESULT) :])) for line in lines]


def measure_apart(points: list[tuple[int, int, int]], rows: int = 2) -> list[TapePoint]:
    """:func:`measure` of each ``(hidden, intermediate, seq)`` in a process of its own, all at
    once (RSS is per process): memory a finished measurement freed stays in the allocator's
    pool and would be reused by the next one's tapes, hiding them."""
    import json
    import subprocess

    module = [sys.executable, "-m", "graph_exec.harness.tape_fit", "--point"]
    runs = [
        subprocess.Popen([*module, *map(str, (h, s, rows, i))], stdout=subprocess.PIPE, text=True)
        for h, i, s in points
    ]
    out = []
    for run in runs:
        stdout, _ = run.communicate()
        if run.returncode:
            raise RuntimeError(f"a tape measurement failed (exit {run.returncode}): {run.args}")
        line = next(x for x in stdout.splitlines() if x.startswith(RESULT))
        out.append(TapePoint(**json.loads(line[len(RESULT) :])))
    return out


def main(argv: list[str]) -> int:
    import json
    from dataclasses import asdict

    from graph_exec.msenv import prepare_mindspore

    if argv[:1] == ["--together"]:
        prepare_mindspore("CPU")
        rows = int(argv[-1].removeprefix("--rows="))
        keep: list[Any] = []
        for point in argv[1:-1]:
            hidden, intermediate, seq = (int(x) for x in point.split(","))
            measured = measure(hidden, seq, rows, intermediate=intermediate, keep=keep)
            print(RESULT + json.dumps(asdict(measured)), flush=True)
        return 0
    if argv[:1] == ["--point"]:
        prepare_mindspore("CPU")
        hidden, seq, rows, intermediate = (int(x) for x in argv[1:5])
        print(RESULT + json.dumps(asdict(measure(hidden, seq, rows, intermediate=intermediate))), flush=True)
        return 0
    points = measure_apart(list(GRID))
    a, c, d = fit(points)
    print(f"fitted (A, C, D) = ({a:.2f}, {c:.2f}, {d:.2f})")
    for p in points:
        predicted = layer_tape_bytes(p.shape(), p.rows, p.seq, 4)
        print(
            f"h={p.hidden} i={p.intermediate} heads={p.heads} s={p.seq} b={p.rows}: measured "
            f"{p.measured / 2**20:.2f} MiB, formula {predicted / 2**20:.2f} MiB ({predicted / p.measured:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
