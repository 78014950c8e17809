"""The cells a split MindSpore ONE model is made of: pipeline chunks and the preprocess blocks.

Every cell holds the model's *own* layers (decoder blocks, embedding, final norm, head, vision
blocks); nothing is copied or re-implemented, so a chunk computes exactly what the whole model
computes for its layers. What the whole model's ``construct`` computes once and hands to every
block (the causal mask, the rotary cos/sin) each chunk computes for itself from what travels
with the activations: the hidden states and the position ids. That keeps chunks inside the
schedules' contract (a chunk takes the previous stage's output tuple) and every tensor a
compiled graph sees is an input or a constant of its shape.

What travels between stages: ``(hidden, position_ids)``; position ids are integer tensors and
take no gradient. ``position_ids`` is ``(B, S)`` for Llama and Qwen2 and ``(B, 3, S)`` for
Qwen2-VL (batch first, so that a batch can be cut into micro-batches on dim 0; the chunk turns
it into the ``(3, B, S)`` the model's rotary embedding takes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops


@dataclass(frozen=True)
class Family:
    """How one model family's decoder is called (fixed per ``config.model_type``)."""

    model_type: str
    #: The decoder blocks return a 1-tuple (Qwen2, Qwen2-VL) rather than a tensor (Llama).
    block_returns_tuple: bool
    #: Position ids carry the three M-RoPE rows (Qwen2-VL).
    multimodal_positions: bool


FAMILIES = {
    "llama": Family("llama", block_returns_tuple=False, multimodal_positions=False),
    "qwen2": Family("qwen2", block_returns_tuple=True, multimodal_positions=False),
    "qwen2_vl": Family("qwen2_vl", block_returns_tuple=True, multimodal_positions=True),
}


def mask_value(dtype: Any) -> float:
    """The additive mask value of masked positions: the dtype's most negative number, as the
    models use (any value that makes ``exp`` underflow gives the same softmax exactly)."""
    return float(np.finfo(ms.dtype_to_nptype(dtype)).min)


class DecoderChunk(nn.Cell):
    """A run of the model's decoder blocks, optionally led by the token embedding (and, for a
    vision-language model, the insertion of the image embeddings) and closed by norm + head.

    ``construct(x, position_ids[, image_embeds])``: ``x`` is the token ids when the chunk
    embeds, else the hidden states; returns ``(hidden, position_ids)``, or the logits when the
    chunk holds the head. ``dtype`` is the model's compute dtype (of the causal mask).
    """

    def __init__(
        self,
        family: Family,
        blocks: list[nn.Cell],
        rotary: nn.Cell,
        dtype: Any,
        *,
        embed: nn.Cell | None = None,
        image_token_id: int | None = None,
        norm: nn.Cell | None = None,
        head: nn.Cell | None = None,
    ) -> None:
        super().__init__()
        self.family = family
        self.blocks = nn.CellList(blocks)
        self.rotary = rotary
        self.embed = embed
        self.merges_images = image_token_id is not None
        self.image_token_id = -1 if image_token_id is None else int(image_token_id)
        self.norm = norm
        self.head = head
        self.block_returns_tuple = family.block_returns_tuple
        self.multimodal_positions = family.multimodal_positions
        self.masked = mask_value(dtype)

    def construct(self, x: Tensor, position_ids: Tensor, image_embeds: Tensor | None = None) -> Any:
        hidden = x
        if self.embed is not None:
            hidden = self.embed(x)
            if self.merges_images:
                hidden = insert_images(hidden, x, image_embeds, self.image_token_id)
        positions = position_ids.transpose(1, 0, 2) if self.multimodal_positions else position_ids
        seq = hidden.shape[1]
        mask = ops.triu(ops.full((1, 1, seq, seq), self.masked, dtype=hidden.dtype), 1)
        cos, sin = self.rotary(hidden, positions)
        for block in self.blocks:
            out = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
            hidden = out[0] if self.block_returns_tuple else out
        if self.head is not None:
            return self.head(self.norm(hidden))
        return hidden, position_ids


class MultimodalRotary(nn.Cell):
    """Qwen2-VL's text rotary embedding (``Qwen2VLRotaryEmbedding``), the same arithmetic in
    the same order, written so that it compiles: the model's ``construct`` expands its
    ``inv_freq`` with a ``-1`` dimension, which fails under ``mindspore.jit`` in 2.10
    (``The method 'GetShapeVector()' doesn't implement``). Reads the model's own ``inv_freq``
    and scaling, so it follows any rope initialisation the config chose (not the dynamic
    kinds, which re-initialise from the sequence length)."""

    def __init__(self, rotary: nn.Cell) -> None:
        super().__init__()
        if "dynamic" in rotary.rope_type:
            raise ValueError(f"rope type {rotary.rope_type!r} is not supported in a pipeline chunk")
        self.inv_freq = Tensor(rotary.inv_freq.asnumpy())
        self.scaling = float(rotary.attention_scaling)

    def construct(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        rows, batch = position_ids.shape[0], position_ids.shape[1]
        inv_freq = self.inv_freq.reshape(1, 1, -1, 1).astype(ms.float32)
        inv_freq = inv_freq.broadcast_to((rows, batch, inv_freq.shape[2], 1))
        positions = position_ids.expand_dims(2).astype(ms.float32)
        freqs = ops.matmul(inv_freq, positions).transpose(0, 1, 3, 2)
        angles = ops.cat((freqs, freqs), axis=-1)
        cos = angles.cos() * self.scaling
        sin = angles.sin() * self.scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def insert_images(
    text: Tensor, ids: Tensor, images: Tensor, image_token_id: int, real: Tensor | None = None
) -> Tensor:
    """``text`` (B, S, H) with the image positions (``ids == image_token_id``, and ``real``
    where given: padding is never an image position) replaced, in order, by the rows of
    ``images`` (B, N, H): what the model's ``masked_scatter`` does, sample by sample (a sample
    with fewer than ``N`` image tokens leaves its last rows, the padding, unused). A one-hot
    matmul and a select, both exact (each output is one input value plus zeros) and
    differentiable on every target."""
    is_image = ids == image_token_id
    if real is not None:
        is_image = ops.logical_and(is_image, real)
    rank = ops.cumsum(is_image.astype(ms.int32), 1) - 1
    rank = ops.clip(rank, 0, images.shape[1] - 1)
    pick = ops.one_hot(rank, images.shape[1], Tensor(1.0, text.dtype), Tensor(0.0, text.dtype))
    placed = ops.bmm(pick, images.astype(text.dtype))
    return ops.select(is_image.expand_dims(-1).broadcast_to(text.shape), placed, text)


class EmbeddingPreprocess(nn.Cell):
    """The token embedding as the preprocess of a language model: ``(ids, position_ids) ->
    (embeddings, position_ids)``."""

    def __init__(self, embed: nn.Cell) -> None:
        super().__init__()
        self.embed = embed

    def construct(self, ids: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.embed(ids), position_ids


class MaskedEmbeddingPreprocess(nn.Cell):
    """The token embedding as the preprocess of a language model split with ``packed=True``:
    ``(ids, position_ids, attention_mask) -> (embeddings, position_ids, attention_mask)``."""

    def __init__(self, embed: nn.Cell) -> None:
        super().__init__()
        self.embed = embed

    def construct(
        self, ids: Tensor, position_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.embed(ids), position_ids, attention_mask


class VisionPreprocess(nn.Cell):
    """Qwen2-VL's vision tower (patch embedding, vision blocks, patch merger) as the preprocess.

    ``construct(pixel_values, ids, position_ids) -> (ids, position_ids, image_embeds)`` with
    ``pixel_values`` (B, patches, C·T·P·P): every sample one image of the grid fixed here. The
    rotary cos/sin of that grid are computed once, eagerly (the model's ``rot_pos_emb`` reads
    tensor values, which a compiled graph cannot), and the per-image sequence boundaries
    (``cu_seqlens``) from the micro-batch's size.
    """

    def __init__(self, visual: nn.Cell, grid_thw: tuple[int, int, int]) -> None:
        super().__init__()
        self.patch_embed = visual.patch_embed
        self.blocks = visual.blocks
        self.merger = visual.merger
        t, h, w = grid_thw
        self.patches = t * h * w
        self.tokens = self.patches // visual.spatial_merge_size**2
        rotary = visual.rot_pos_emb(Tensor(np.array([grid_thw], np.int64)))
        angles = ops.cat((rotary, rotary), axis=-1)
        self.cos = Tensor(angles.cos().asnumpy())
        self.sin = Tensor(angles.sin().asnumpy())

    def construct(
        self, pixel_values: Tensor, ids: Tensor, position_ids: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        images = pixel_values.shape[0]
        hidden = self.patch_embed(pixel_values.reshape(images * self.patches, -1))
        cos = ops.tile(self.cos, (images, 1))
        sin = ops.tile(self.sin, (images, 1))
        # Python ints, not a tensor: the vision attention slices its mask by these bounds, and
        # with tensor bounds that slice assignment fails in a compiled graph (TensorScatterUpdate
        # shape error, MindSpore 2.10); static bounds compile and give the same result.
        bounds = tuple([k * self.patches for k in range(images + 1)])
        for block in self.blocks:
            hidden = block(hidden, cu_seqlens=bounds, position_embeddings=(cos, sin))
        merged = self.merger(hidden)
        return ids, position_ids, merged.reshape(images, self.tokens, -1)


def padded_causal_mask(attention_mask: Tensor, dtype: Any, masked: float) -> Tensor:
    """``(B, 1, S, S)`` additive mask from segment ids ``attention_mask`` (B, S): 0 where query
    ``i`` may read key ``j``, ``masked`` elsewhere. A key is read when ``j <= i``, it is a real
    token (``attention_mask[b, j] != 0``) and, for a real query, of the query's own segment
    (packed rows: :mod:`graph_exec.models.packed_batch`). With a 0/1 padding mask that is
    exactly what the model's own mask code builds (causal, padding keys masked): a real
    query's real keys are all segment 1, and a padding query reads the real keys before it."""
    batch, seq = attention_mask.shape[0], attention_mask.shape[1]
    causal = ops.triu(ops.full((1, 1, seq, seq), masked, dtype=dtype), 1).broadcast_to((batch, 1, seq, seq))
    keys = attention_mask.reshape(batch, 1, 1, seq)
    queries = attention_mask.reshape(batch, 1, seq, 1)
    other = ops.logical_and(queries != 0, queries != keys)
    blocked = ops.logical_or(keys == 0, other).broadcast_to((batch, 1, seq, seq))
    return ops.masked_fill(causal, blocked, Tensor(masked, dtype))


class MaskedDecoderChunk(DecoderChunk):
    """:class:`DecoderChunk` for padded batches (:func:`graph_exec.models.vlm_batch`): the
    padding mask ``(B, S)`` int travels with ``(hidden, position_ids)``, and every block gets
    the causal mask with the padding keys masked too.

    ``construct(x, position_ids, attention_mask[, image_embeds])`` returns
    ``(hidden, position_ids, attention_mask)``, or the logits when the chunk holds the head
    (the labels are ``-100`` at pads, so pads carry no loss). Stage 0 places each sample's
    image rows in the sample's image positions in order, pads ignored."""

    def construct(  # type: ignore[override]
        self, x: Tensor, position_ids: Tensor, attention_mask: Tensor, image_embeds: Tensor | None = None
    ) -> Any:
        hidden = x
        if self.embed is not None:
            hidden = self.embed(x)
            if self.merges_images:
                hidden = insert_images(hidden, x, image_embeds, self.image_token_id, attention_mask != 0)
        positions = position_ids.transpose(1, 0, 2) if self.multimodal_positions else position_ids
        mask = padded_causal_mask(attention_mask, hidden.dtype, self.masked)
        cos, sin = self.rotary(hidden, positions)
        for block in self.blocks:
            out = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
            hidden = out[0] if self.block_returns_tuple else out
        if self.head is not None:
            return self.head(self.norm(hidden))
        return hidden, position_ids, attention_mask


class VisionBatchPreprocess(nn.Cell):
    """Qwen2-VL's vision tower for batches of any images (:func:`graph_exec.models.vlm_batch`).

    ``construct(pixel_values, patch_image, patch_positions, ids, position_ids, attention_mask)
    -> (ids, position_ids, attention_mask, image_embeds)``: ``pixel_values`` (B, P, C·T·p·p)
    holds each sample's images' patches padded to ``P``; ``image_embeds`` (B, P / merge², H)
    the merger's rows in the same order. Everything that depends on the images is computed from
    the micro-batch's own tensors, in the graph, so any mix of images of one padded shape runs
    one compiled graph:

    - the rotary cos/sin of each patch: its (row, column) times the model's own vision rotary
      ``inv_freq`` (the entries of the table ``rot_pos_emb`` gathers from, the same float32
      products), doubled and cos/sin'd as the model's ``construct`` does;
    - the per-image attention bounds: a block-diagonal mask from ``patch_image``, a patch reads
      the patches of its own image only (padding reads padding), where the model's
      ``VisionAttention`` builds the same bounds from Python ``cu_seqlens``.

    Each vision block is the model's own: its ``norm1``, ``attn.qkv``, the model's
    ``apply_rotary_pos_emb_vision``, ``attn.proj``, ``norm2`` and ``mlp``, the attention
    arithmetic that of ``VisionAttention`` (batched per sample instead of over one long
    sequence: a row's softmax sees the same keys, the others get weight exactly 0).
    """

    def __init__(self, visual: nn.Cell) -> None:
        super().__init__()
        from mindone.transformers.models.qwen2_vl import modeling_qwen2_vl

        self.patch_embed = visual.patch_embed
        self.blocks = visual.blocks
        self.merger = visual.merger
        self.merge_rows = visual.spatial_merge_size**2
        self.inv_freq = Tensor(visual.rotary_pos_emb.inv_freq.asnumpy())
        self.rotate = modeling_qwen2_vl.apply_rotary_pos_emb_vision
        attn = visual.blocks[0].attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.scale = math.sqrt(attn.head_dim)
        self.masked = mask_value(visual.blocks[0].mlp.fc2.weight.dtype)

    def construct(
        self,
        pixel_values: Tensor,
        patch_image: Tensor,
        patch_positions: Tensor,
        ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        batch, patches = pixel_values.shape[0], pixel_values.shape[1]
        hidden = self.patch_embed(pixel_values.reshape(batch * patches, -1))
        freqs = patch_positions.astype(ms.float32).expand_dims(-1) * self.inv_freq
        freqs = freqs.reshape(batch * patches, -1)
        angles = ops.cat((freqs, freqs), axis=-1)
        cos, sin = angles.cos(), angles.sin()
        other = patch_image.expand_dims(2) != patch_image.expand_dims(1)
        zeros = ops.zeros((batch, 1, patches, patches), hidden.dtype)
        mask = ops.masked_fill(zeros, other.expand_dims(1), Tensor(self.masked, hidden.dtype))
        for block in self.blocks:
            hidden = hidden + self._attend(block.attn, block.norm1(hidden), mask, cos, sin, batch, patches)
            hidden = hidden + block.mlp(block.norm2(hidden))
        merged = self.merger(hidden)
        return ids, position_ids, attention_mask, merged.reshape(batch, patches // self.merge_rows, -1)

    def _attend(
        self, attn: nn.Cell, x: Tensor, mask: Tensor, cos: Tensor, sin: Tensor, batch: int, patches: int
    ) -> Tensor:
        """``VisionAttention.construct`` with ``mask`` for the bounds (see the class docstring)."""
        rows = batch * patches
        qkv = attn.qkv(x).reshape(rows, 3, self.heads, -1).transpose(1, 0, 2, 3)
        q, k = self.rotate(qkv[0], qkv[1], cos, sin)
        q = q.reshape(batch, patches, self.heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(batch, patches, self.heads, -1).transpose(0, 2, 1, 3)
        v = qkv[2].reshape(batch, patches, self.heads, -1).transpose(0, 2, 1, 3)
        weights = ops.matmul(q, k.transpose(0, 1, 3, 2)) / self.scale
        weights = ops.softmax((weights + mask).astype(ms.float32), -1).astype(q.dtype)
        out = ops.matmul(weights, v).transpose(0, 2, 1, 3).reshape(rows, -1)
        return attn.proj(out)
