"""A vision-language model whose compute-heavy vision tower is the preprocess (frozen by default).

This is the case MPipe Transpose is built for: the tower's forward is expensive, it needs no
gradient, so each rank runs it for the micro-batches it owns during its idle warm-up and only
the features travel to rank 0. The tower is a patch embedding followed by residual
convolution blocks; a projector turns its feature map into image tokens. The body is a small
causal transformer LM over ``[image tokens; text tokens]`` that predicts the next text token.

Synthetic task: every image is a noisy pattern of one of ``CLASSES`` kinds, and the text is a
sequence that counts upward from an offset set by that kind, so the loss falls as the body
learns to read the image tokens.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from graph_exec.examples.common import Example, ExampleModel
from graph_exec.examples.lm import LMConfig, build_lm_stages, lm_cross_entropy

IMAGE, PATCH, CHANNELS, CLASSES, TEXT = 32, 4, 3, 4, 16


class ConvBlock(nn.Cell):
    """Residual ``x + conv(gelu(conv(x)))`` on the patch grid."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, pad_mode="same", has_bias=True)
        self.conv2 = nn.Conv2d(width, width, 3, pad_mode="same", has_bias=True)
        self.act = nn.GELU()

    def construct(self, x: Tensor) -> Tensor:
        return x + self.conv2(self.act(self.conv1(x)))


class VisionTower(nn.Cell):
    """Images ``[B, 3, 32, 32]`` and text ids ``[B, T]`` -> image tokens ``[B, 64, width]``, ids.

    The ids pass through untouched (they stay int32 and take no gradient): the body embeds them.
    """

    def __init__(self, tower_width: int, depth: int, width: int) -> None:
        super().__init__()
        self.patches = nn.Conv2d(CHANNELS, tower_width, PATCH, stride=PATCH, pad_mode="valid", has_bias=True)
        self.blocks = nn.CellList([ConvBlock(tower_width) for _ in range(depth)])
        self.project = nn.Dense(tower_width, width)

    def construct(self, images: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        x = self.patches(images)
        for block in self.blocks:
            x = block(x)
        batch, channels = x.shape[0], x.shape[1]
        tokens = x.reshape(batch, channels, -1).transpose(0, 2, 1)
        return self.project(tokens), ids


class TextBody(nn.Cell):
    """Stage 0 of the body: embed the text ids and prepend the image tokens."""

    def __init__(self, config: LMConfig, chunk: nn.Cell) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.width)
        self.chunk = chunk

    def construct(self, image_tokens: Tensor, ids: Tensor) -> Tensor:
        return self.chunk(ops.concat((image_tokens, self.embed(ids)), axis=1))


def _text_body(config: LMConfig, chunk: nn.Cell) -> TextBody:
    """Stage 0 around ``chunk``, its blocks keeping their split-independent names: MindSpore
    renames a cell's parameters by their attribute path when the cell is set on another
    (``chunk.blocks.0…``), which would name block 1 ``chunk.blocks.1`` at P = 2 and
    ``lm.blocks.1`` at P = 4, so a checkpoint could not load under another split."""
    names = {id(param): param.name for param in chunk.get_parameters()}
    body = TextBody(config, chunk)
    for param in chunk.get_parameters():
        param.name = names[id(param)]
    body.embed.update_parameters_name("lm.stage0.text.")
    return body


def text_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token loss over the text positions only (the image positions predict nothing)."""
    return lm_cross_entropy(logits[:, -labels.shape[1] :], labels)


def make_batch(step: int, batch_size: int, vocab: int) -> tuple[tuple[Tensor, ...], Tensor]:
    rng = np.random.default_rng(step)
    kinds = rng.integers(0, CLASSES, batch_size)
    grid = np.linspace(0, np.pi * 2, IMAGE, dtype=np.float32)
    patterns = np.stack(
        [np.sin((k + 1) * grid)[None, :] * np.cos((k + 1) * grid)[:, None] for k in range(CLASSES)]
    )
    images = patterns[kinds][:, None] + 0.3 * rng.standard_normal((batch_size, CHANNELS, IMAGE, IMAGE))
    start = kinds[:, None] * (vocab // CLASSES) + np.arange(TEXT + 1)[None, :]
    text = (start % vocab).astype(np.int32)
    return (Tensor(images.astype(np.float32)), Tensor(text[:, :-1])), Tensor(text[:, 1:])


def build(
    num_stages: int, trainable_preprocess: bool = False, seed: int = 0, size: str = "small"
) -> ExampleModel:
    """The model split into ``num_stages`` body chunks; the tower is frozen unless asked."""
    import mindspore as ms

    tower_width, depth, layers = {"tiny": (16, 1, 2), "small": (48, 3, 4)}[size]
    ms.set_seed(seed)
    config = LMConfig(
        vocab=64, width=64, heads=4, layers=max(layers, num_stages), seq=(IMAGE // PATCH) ** 2 + TEXT
    )
    tower = VisionTower(tower_width, depth, config.width)
    tower.update_parameters_name("tower.")
    if not trainable_preprocess:
        for param in tower.get_parameters():
            param.requires_grad = False
    chunks = build_lm_stages(config, num_stages, embedding=False, prefix="lm")
    stages = [_text_body(config, chunks[0]), *chunks[1:]]
    return ExampleModel(
        preprocess=tower,
        num_transpose_layers=1 + depth,
        stages=stages,
        loss_fn=text_loss,
        make_batch=lambda step, batch_size: make_batch(step, batch_size, config.vocab),
        summary=f"vision tower {tower_width}ch x {depth} conv blocks ({'trainable' if trainable_preprocess else 'frozen'}), "
        f"LM body width {config.width}, {config.layers} blocks, {TEXT} text tokens after 64 image tokens",
    )


EXAMPLE = Example(
    "vl_tower", "frozen vision tower feeding a small transformer LM", build, trainable_by_default=False
)
