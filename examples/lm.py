"""Small transformer-LM building blocks, shared by the examples, tests and benchmarks.

Everything here is a plain ``mindspore.nn.Cell`` with static shapes, so the same blocks run
eagerly (pynative executor) and inside ``mindspore.jit`` (graph executor). The model is split
into pipeline chunks by :func:`build_lm_stages`, which names every block by its place in the
whole model: MindSpore requires unique parameter names within a graph, the executors key
gradients by name, and a checkpoint loads by name under another split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer


@dataclass(frozen=True)
class LMConfig:
    """Sizes of the example LM; every block is built from these.

    ``seq`` is the longest sequence the model accepts (learned positions and the causal mask
    are built for it); shorter sequences use their leading part.
    """

    vocab: int = 256
    width: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")


class TokenEmbedding(nn.Cell):
    """Token ids ``[B, S]`` (int32) → embeddings ``[B, S, width]`` with learned positions."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.width, embedding_table=Normal(0.02))
        self.positions = Parameter(initializer(Normal(0.02), (config.seq, config.width)), name="positions")

    def construct(self, ids: Tensor) -> Tensor:
        seq = ids.shape[1]
        return self.tokens(ids) + self.positions[:seq]


class CausalSelfAttention(nn.Cell):
    """Multi-head self-attention where position ``i`` only sees positions ``<= i``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.width // config.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Dense(config.width, 3 * config.width)
        self.proj = nn.Dense(config.width, config.width)
        # Additive mask for the longest sequence; shorter sequences slice its top-left corner.
        # A constant Tensor (not a Parameter): it never trains and never gets a gradient.
        upper = np.triu(np.ones((config.seq, config.seq), dtype=np.float32), k=1)
        self.mask = Tensor(upper * np.float32(-1e9))

    def construct(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(x).reshape(batch, seq, 3, self.heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale + self.mask[:seq, :seq]
        attn = ops.softmax(scores, axis=-1)
        out = ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(batch, seq, width)
        return self.proj(out)


class MLP(nn.Cell):
    """Position-wise feed-forward: width → mlp_ratio·width → width with GELU."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.width
        self.up = nn.Dense(config.width, hidden)
        self.act = nn.GELU()
        self.down = nn.Dense(hidden, config.width)

    def construct(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Cell):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm((config.width,), epsilon=1e-5)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm((config.width,), epsilon=1e-5)
        self.mlp = MLP(config)

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Cell):
    """Final layer norm and projection to vocabulary logits ``[B, S, vocab]``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((config.width,), epsilon=1e-5)
        self.out = nn.Dense(config.width, config.vocab)

    def construct(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


def lm_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy of ``logits [B, S, V]`` against int32 ``labels [B, S]``."""
    vocab = logits.shape[-1]
    return ops.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="mean")


def masked_lm_cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the positions where ``mask [B, S]`` is 1: the loss of
    a batch padded along the sequence (``shapes="buckets"`` appends the mask after the labels)
    equals :func:`lm_cross_entropy` of the unpadded batch."""
    vocab = logits.shape[-1]
    weights = mask.reshape(-1)
    losses = ops.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    return (losses * weights).sum() / weights.sum()


class LMChunk(nn.Cell):
    """One pipeline chunk: an optional embedding, a run of blocks, an optional head."""

    def __init__(self, config: LMConfig, num_blocks: int, *, embedding: bool, head: bool) -> None:
        super().__init__()
        self.embedding = TokenEmbedding(config) if embedding else None
        self.blocks = nn.CellList([Block(config) for _ in range(num_blocks)])
        self.head = LMHead(config) if head else None

    def construct(self, x: Tensor) -> Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def split_layers(layers: int, num_stages: int) -> list[int]:
    """Blocks per stage, as even as possible, earlier stages taking the remainder."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    base, extra = divmod(layers, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]


def build_lm_stages(
    config: LMConfig,
    num_stages: int,
    *,
    embedding: bool = True,
    head: bool = True,
    prefix: str = "lm",
    layers: Sequence[int] | None = None,
) -> list[LMChunk]:
    """Build the LM as ``num_stages`` chunks, ``layers[k]`` blocks in chunk ``k`` (default: as
    even as possible), with parameter names that do not depend on the split:
    ``{prefix}.blocks.{i}.…`` for block ``i`` of the whole model, ``{prefix}.embedding.…``,
    ``{prefix}.head.…`` (a checkpoint then loads by name under any split).

    ``embedding`` puts the token embedding in chunk 0 (leave it out when a preprocess block
    produces the hidden states); ``head`` puts the final norm and LM head in the last chunk.
    """
    counts = split_layers(config.layers, num_stages) if layers is None else list(layers)
    if len(counts) != num_stages or sum(counts) != config.layers or min(counts) < 0:
        raise ValueError(
            f"layers must be {num_stages} block counts >= 0 summing to {config.layers}, got {layers!r}"
        )
    stages, first = [], 0
    for k, count in enumerate(counts):
        chunk = LMChunk(config, count, embedding=embedding and k == 0, head=head and k == num_stages - 1)
        for offset, block in enumerate(chunk.blocks):
            block.update_parameters_name(f"{prefix}.blocks.{first + offset}.")
        for part in ("embedding", "head"):
            if getattr(chunk, part) is not None:
                getattr(chunk, part).update_parameters_name(f"{prefix}.{part}.")
        stages.append(chunk)
        first += count
    return stages
