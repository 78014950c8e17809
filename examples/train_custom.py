"""Train your own model with the MPipe Transpose schedule: the README's Usage, runnable.

Everything a user writes is here in plain MindSpore: a model split into a replicated
preprocess (a token embedding) and ``V x P`` body chunks, synthetic data, the loss and Adam,
stepped by ``sched.step`` (clipping by the global gradient norm of the whole pipeline).
The block between the ``Usage`` markers is shown verbatim in README.md (a test keeps them
equal). Run it as one process (every stage local, no communication)::

    python -m graph_exec.examples.train_custom --steps 20

or pipelined over 2 ranks with msrun (pick a free port: see README.md, "Usage")::

    msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 --master_port=PORT \\
          --join=True --cluster_time_out=60 --log_dir=logs train_custom.py --steps 20

The rank holding the last stage prints ``step K loss L`` (the mean over micro-batches).
"""

from __future__ import annotations

import argparse
import os
from statistics import fmean

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

import graph_exec as ge
from graph_exec.msenv import local_device_id, prepare_mindspore

VOCAB, TOKENS, WIDTH, CLASSES = 64, 8, 32, 4


class Embedding(nn.Cell):
    """The preprocess: token ids ``[B, TOKENS]`` -> features ``[B, WIDTH]`` (mean of embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def construct(self, tokens: Tensor) -> Tensor:
        return self.table(tokens).mean(axis=1)


class Block(nn.Cell):
    """One body chunk: a residual tanh layer; the last chunk adds the classifier head."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.hidden = nn.Dense(WIDTH, WIDTH)
        self.head = nn.Dense(WIDTH, CLASSES) if last else None

    def construct(self, x: Tensor) -> Tensor:
        x = x + ops.tanh(self.hidden(x))
        return x if self.head is None else self.head(x)


class TinyClassifier(nn.Cell):
    """The whole model. ``chunks`` is an ``nn.CellList``, so every parameter gets a unique name
    (``chunks.3.hidden.weight``): the schedule keys gradients by name and rejects duplicates."""

    def __init__(self, num_stages: int, seed: int) -> None:
        super().__init__()
        import mindspore as ms

        ms.set_seed(seed)  # the same initial weights on every rank
        self.embedding = Embedding()
        self.chunks = nn.CellList([Block(last=s == num_stages - 1) for s in range(num_stages)])

    def construct(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for chunk in self.chunks:
            x = chunk(x)
        return x


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """``loss_fn(output, *labels)``: called on the last stage with its output and the labels."""
    return ops.cross_entropy(logits, labels, reduction="mean")


def make_batch(step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch, identical on every rank: the label is the token sum mod 4."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, VOCAB, (batch_size, TOKENS), dtype=np.int32)
    return tokens, (tokens.sum(axis=1) % CLASSES).astype(np.int32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small classifier with the MPipe Transpose schedule (one process or msrun)."
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per rank (default 2)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument(
        "--batch", type=int, default=16, help="global batch, a multiple of --micro (default 16)"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    parser.add_argument(
        "--max-norm", type=float, default=1.0, help="clip the global gradient norm to this (default 1.0)"
    )
    parser.add_argument(
        "--mode", choices=("graph", "pynative"), default="graph", help="executor (default graph)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    parser.add_argument("--device", default="CPU", help="MindSpore device target (default CPU)")
    parser.add_argument("--verbose", action="store_true", help="keep MindSpore's warnings")
    args = parser.parse_args(argv)
    for name in ("steps", "vpp", "micro", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.max_norm > 0:
        parser.error(f"--max-norm must be > 0 (inf: no clipping), got {args.max_norm}")
    if args.batch % args.micro:
        parser.error(f"--batch {args.batch} is not a multiple of --micro {args.micro}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # --- Usage: begin (README.md shows this block verbatim) ---
    prepare_mindspore(args.device, device_id=local_device_id(args.device), verbose=args.verbose)
    launched_by_msrun = "MS_ROLE" in os.environ  # else: one process holding every stage
    if launched_by_msrun:
        init()  # MindSpore communication: MCCL on CPU, HCCL on Ascend
    rank, pp = (get_rank(), get_group_size()) if launched_by_msrun else (0, 1)

    num_stages = args.vpp * pp  # V chunks per rank; stage s lives on rank s mod P
    model = TinyClassifier(num_stages, seed=args.seed)  # built identically on every rank
    stages = [ge.PipelineStage(model.chunks[s], s, num_stages) for s in range(rank, num_stages, pp)]
    sched = ge.ScheduleMPipeTranspose(
        stages,
        micro_batch_num=args.micro,
        preprocess_module=model.embedding,  # replicated on every rank, run on idle ones
        num_transpose_layers=1,  # how many layers of stage 0 the preprocess module holds
        mode=args.mode,
        loss_fn=cross_entropy,  # loss_fn(last stage output, *labels)
        scale_grads=True,  # gradients of the mean over micro-batches
    )
    params = sched.trainable_params()  # what this rank trains (rank 0 also owns the embedding)
    optimizer = nn.Adam(params, learning_rate=args.lr)
    for step in range(args.steps):
        tokens, labels = make_batch(step, args.batch)  # numpy or Tensor; the same on every rank
        losses = sched.run(tokens, labels=labels)  # M losses on the last stage's rank, else None
        sched.step(optimizer, max_norm=args.max_norm)  # clip by the global norm, Adam, zero_grad
        if losses is not None:  # the mean over micro-batches
            print(f"step {step + 1} loss {fmean(float(x.asnumpy()) for x in losses):.6f}", flush=True)
    # --- Usage: end ---


if __name__ == "__main__":
    main()
