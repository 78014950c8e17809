"""A transformer LM whose trainable token embedding and first block are the preprocess.

The embedding is replicated on every rank and its forward for owned micro-batches is
transposed onto idle warm-up ranks; its gradient comes from the explicit recompute-backward
(central on rank 0, or on the owners with ``--backward owner``), and rank 0 broadcasts the
updated weights at every step.

Synthetic task: each sequence counts upward with a stride of 1, 2 or 3 from a random start
(modulo the vocabulary); the model learns to continue it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mindspore import Tensor, nn

from graph_exec.examples.common import Example, ExampleModel
from graph_exec.examples.lm import (
    Block,
    LMConfig,
    TokenEmbedding,
    build_lm_stages,
    lm_cross_entropy,
    masked_lm_cross_entropy,
)

SEQ = 32


class EmbeddingAndBlock(nn.Cell):
    """The preprocess: token embedding (with positions) and the first transformer block."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.embedding = TokenEmbedding(config)
        self.block = Block(config)

    def construct(self, ids: Tensor) -> Tensor:
        return self.block(self.embedding(ids))


def make_batch(
    step: int, batch_size: int, vocab: int, length: int = SEQ
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Token ids ``[batch_size, length]`` (int32) and their next tokens, seeded by ``step``."""
    rng = np.random.default_rng(step)
    start = rng.integers(0, vocab, (batch_size, 1))
    stride = rng.integers(1, 4, (batch_size, 1))
    seq = ((start + stride * np.arange(length + 1)[None, :]) % vocab).astype(np.int32)
    return (Tensor(seq[:, :-1]),), Tensor(seq[:, 1:])


def build(
    num_stages: int,
    trainable_preprocess: bool = True,
    seed: int = 0,
    size: str = "small",
    max_seq: int = SEQ,
    layers: Sequence[int] | None = None,
) -> ExampleModel:
    """The model split into ``num_stages`` body chunks after the embedding-and-block preprocess;
    ``max_seq``: the longest sequence it takes (positions and causal mask), batches are ``SEQ``
    long unless a length is asked for (``ExampleModel.batch(step, rows, length)``); ``layers``:
    blocks per chunk (a rebalanced split; default as even as possible), summing to the model's
    block count."""
    import mindspore as ms

    width, depth = {"tiny": (32, 2), "small": (64, 4)}[size]
    ms.set_seed(seed)
    blocks = max(depth, num_stages) if layers is None else sum(layers)
    config = LMConfig(vocab=128, width=width, heads=4, layers=blocks, seq=max(max_seq, SEQ))
    pre = EmbeddingAndBlock(config)
    pre.update_parameters_name("pre.")
    if not trainable_preprocess:
        for param in pre.get_parameters():
            param.requires_grad = False
    return ExampleModel(
        preprocess=pre,
        num_transpose_layers=2,
        stages=build_lm_stages(config, num_stages, embedding=False, prefix="lm", layers=layers),
        loss_fn=lm_cross_entropy,
        masked_loss_fn=masked_lm_cross_entropy,
        make_batch=lambda step, batch_size, length=SEQ: make_batch(step, batch_size, config.vocab, length),
        summary=f"embedding + 1 block ({'trainable' if trainable_preprocess else 'frozen'}) as preprocess, "
        f"LM body width {width}, {config.layers} blocks, vocab {config.vocab}, sequence {SEQ} (at most {config.seq})",
    )


EXAMPLE = Example(
    "embed_lm", "transformer LM with a trainable embedding preprocess", build, trainable_by_default=True
)
