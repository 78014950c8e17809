"""Shape buckets on real ranks: padded runs against the reference on the unpadded batch.

One msrun launch (P = 2). Every rank builds the ``embed_lm`` example (tiny, 2 stages, same
seed), keeps its own chunk, and trains with ``shapes="buckets"``, ``shape_buckets={1: (8, 16,
32)}`` on batches of lengths 5, 12 and 16 (buckets 8, 16, 16) and a masked loss. Each step is
compared with a single-process, non-pipelined reference on the *unpadded* batch with the same
loss and a mask of ones: per-micro losses on the last rank, every gradient this rank trains
(atol 1e-5 / rtol 1e-4). Both schedules, both modes, frozen and trainable preprocess, the mean
(masked mean with ``scale_grads``) and the per-token reduction. The third step (a bucket seen
before) must compile nothing, by the library's count and by MindSpore's own. A length above
the largest bucket is refused on every rank before any message.

Usage: ``shape_checks.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, ops
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.examples import embed_lm
from graph_exec.examples.lm import masked_lm_cross_entropy
from graph_exec.msenv import prepare_mindspore
from tests.models.common import ATOL, RTOL, announce_policy
from tests.multirank.workers.pipeline_checks import Checker, grads_numpy, run_suite

BUCKETS = {1: (8, 16, 32)}
LENGTHS = (5, 12, 16)  # buckets 8, 16, 16: the third step compiles nothing
#: A dynamic-shape kernel compiles its first shape and, at the second, one dynamic graph: then never.
DYNAMIC_LENGTHS = (5, 12, 16, 20, 9)
ROWS, MICRO = 4, 2
TIMEOUT_S = 60.0


def masked_token_loss(logits, labels, mask):
    """``(Σ mask·ce, Σ mask)`` over a micro-batch's positions (``loss_reduction="token"``)."""
    vocab = logits.shape[-1]
    weights = mask.reshape(-1)
    losses = ops.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    return (losses * weights).sum(), weights.sum()


@dataclass(frozen=True)
class Case:
    name: str
    mode: str = "graph"
    trainable: bool = True
    token: bool = False
    baseline: bool = False
    shapes: str = "buckets"  # or "dynamic": nothing padded, the mask a label of ones
    recompute: bool = False

    @property
    def lengths(self) -> tuple[int, ...]:
        return DYNAMIC_LENGTHS if self.shapes == "dynamic" else LENGTHS


def reference(model, x: Tensor, y: Tensor, token: bool) -> tuple[list[float], dict[str, np.ndarray]]:
    """Per-micro losses and the step's gradients, non-pipelined, on the unpadded batch."""
    params = [p for cell in (model.preprocess, *model.stages) for p in cell.trainable_params()]
    loss_fn = masked_token_loss if token else masked_lm_cross_entropy

    def objective(x, y, mask):
        h = model.preprocess(x)
        for stage in model.stages:
            h = stage(h)
        out = loss_fn(h, y, mask)
        return out[0] if token else out

    step = ms.value_and_grad(objective, None, ParameterTuple(params))
    rows = x.shape[0] // MICRO
    losses, total, count = [], {p.name: np.zeros(p.shape, np.float32) for p in params}, 0.0
    for m in range(MICRO):
        cut = slice(m * rows, (m + 1) * rows)
        mask = Tensor(np.ones(tuple(x[cut].shape), np.float32))
        value, grads = step(x[cut], y[cut], mask)
        tokens = float(mask.asnumpy().sum())
        losses.append(float(value.asnumpy()) / (tokens if token else 1.0))
        count += tokens
        for param, grad in zip(params, grads, strict=True):
            total[param.name] += grad.asnumpy()
    scale = 1.0 / (count if token else MICRO)
    return losses, {k: v * scale for k, v in total.items()}


def schedule(model, case: Case, rank: int, pp: int):
    stages = [
        ge.PipelineStage(model.stages[s], s, len(model.stages)) for s in range(rank, len(model.stages), pp)
    ]
    options = {
        "mode": case.mode,
        "timeout_s": TIMEOUT_S,
        "shapes": case.shapes,
        "recompute": case.recompute,
        **({"shape_buckets": BUCKETS} if case.shapes == "buckets" else {}),
        "loss_fn": masked_token_loss if case.token else masked_lm_cross_entropy,
        **({"loss_reduction": "token"} if case.token else {"scale_grads": True}),
    }
    kind = ge.ScheduleInterleaved1F1B if case.baseline else ge.ScheduleMPipeTranspose
    return kind(stages, MICRO, model.preprocess, model.num_transpose_layers, **options)


def run_case(case: Case, checker: Checker, rank: int, pp: int) -> None:
    model = embed_lm.build(pp, trainable_preprocess=case.trainable, size="tiny")
    ref = embed_lm.build(pp, trainable_preprocess=case.trainable, size="tiny")
    sched = schedule(model, case, rank, pp)
    last = rank == pp - 1
    trained = {p.name for p in sched.trainable_params()}
    dynamic = case.shapes == "dynamic"

    def labels(y: Tensor):
        """Buckets append the mask themselves; without padding it is a label of ones."""
        return (y, Tensor(np.ones(tuple(y.shape), np.float32))) if dynamic else y

    history = []
    for step, length in enumerate(case.lengths):
        (x,), y = model.batch(100 + step, ROWS, length)
        ref_losses, expected = reference(ref, x, y, case.token)
        losses = sched.run(x, labels=labels(y))
        name = f"{case.name}.len{length}"
        if last:
            got = np.array([float(v.asnumpy()) for v in losses])
            checker.check(
                f"{name}.losses", np.allclose(got, ref_losses, atol=ATOL, rtol=RTOL), f"{got} vs {ref_losses}"
            )
        checker.close(
            f"{name}.grads", grads_numpy(sched), {k: v for k, v in expected.items() if k in trained}
        )
        sched.zero_grad()
        stats = sched.stats()
        history.append(
            (stats["compilations"], stats["mindspore_compilations"], stats["kernel_cache"]["entries"])
        )
    if dynamic:  # one kernel per rank and dtype; MindSpore compiles no more after 2 distinct shapes
        checker.check(
            f"{case.name}.no_compile_after_the_second_shape",
            all(h == history[1] for h in history[2:])
            and all((h[0], h[2]) == (history[0][0], history[0][2]) for h in history),
            f"{history}",
        )
    else:  # the third length falls in the second's bucket
        checker.check(f"{case.name}.seen_bucket_compiles_nothing", history[2] == history[1], f"{history}")
    if case.mode == "graph":
        checker.check(
            f"{case.name}.mindspore_count_exposed",
            isinstance(history[-1][1], int) and history[-1][1] > 0 and history[-1][0] > 0,
            f"{history[-1]}",
        )
    (x,), y = model.batch(200, ROWS, 7)
    ref_losses, _ = reference(ref, x, y, case.token)
    losses = sched.evaluate(x, labels=labels(y))
    if last:
        got = np.array([float(v.asnumpy()) for v in losses])
        checker.check(
            f"{case.name}.evaluate",
            np.allclose(got, ref_losses, atol=ATOL, rtol=RTOL),
            f"{got} vs {ref_losses}",
        )
    if dynamic:
        return
    (x,), y = model.batch(300, ROWS, 33)
    try:
        sched.run(x, labels=y)
        checker.check(f"{case.name}.too_long_refused", False, "run() accepted length 33")
    except ValueError as exc:
        checker.check(
            f"{case.name}.too_long_refused", "above the largest shape bucket 32" in str(exc), str(exc)
        )


CASES = [
    Case("mpipe_trainable_graph_token", token=True),
    Case("mpipe_frozen_graph_mean", trainable=False),
    Case("mpipe_trainable_pynative_mean", mode="pynative"),
    Case("mpipe_frozen_pynative_token", mode="pynative", trainable=False, token=True),
    Case("baseline_trainable_graph_mean", baseline=True),
    Case("dynamic_trainable_graph_token", shapes="dynamic", token=True),
    Case("dynamic_frozen_graph_mean_recompute", shapes="dynamic", trainable=False, recompute=True),
    Case("dynamic_baseline_trainable_pynative_mean", shapes="dynamic", mode="pynative", baseline=True),
]


def main() -> int:
    prepare_mindspore("CPU")
    announce_policy()
    init()
    rank, pp = get_rank(), get_group_size()
    checker = Checker(rank)
    print(f"SUITE shapes cases: {' '.join(case.name for case in CASES)}", flush=True)
    return run_suite(CASES, lambda case: run_case(case, checker, rank, pp), checker)


if __name__ == "__main__":
    sys.exit(main())
