"""Cut a MindSpore ONE causal LM or vision-language model into what the schedules take.

:func:`split_model` takes a ``mindone.transformers`` ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen2VLForConditionalGeneration`` and returns the preprocess module, ``num_transpose_layers``
and ``num_stages`` chunk cells (see :mod:`graph_exec.models.chunks`) built from the model's own
layers. Parameters keep the names they have in the model (``model.layers.3.mlp.up_proj.weight``):
putting a layer into a new cell would rename them after the attribute path (``blocks.0.…``),
and two chunks would then collide, so the names are recorded first and restored after.

Whole-model ``construct`` is not used: it does not compile for Qwen2 and Qwen2-VL (mindone's
mask and M-RoPE index code reads tensor values), and a pipeline needs the layers apart anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindspore import Parameter, nn
from mindspore.common.initializer import initializer
from mindspore.nn.utils import no_init_parameters

from graph_exec.balance import even_layers
from graph_exec.models import cpu_ops
from graph_exec.models.chunks import (
    FAMILIES,
    DecoderChunk,
    EmbeddingPreprocess,
    Family,
    MaskedDecoderChunk,
    MaskedEmbeddingPreprocess,
    MultimodalRotary,
    VisionBatchPreprocess,
    VisionPreprocess,
)
from graph_exec.models.pretrained import checkpoint_names, model_type_of

PREPROCESS = ("embedding", "vision", "none")


@dataclass
class SplitModel:
    """What :func:`split_model` returns: the arguments of the schedules, and facts about them."""

    preprocess: nn.Cell | None  #: the schedules' ``preprocess_module`` (``None``: dataload only)
    num_transpose_layers: int  #: the schedules' ``num_transpose_layers``
    stages: list[nn.Cell]  #: chunk ``s`` is stage ``s`` (stage 0's is the body after the preprocess)
    layers: tuple[int, ...]  #: decoder layers in each stage
    #: ``(embedding weight, head weight)`` when the model ties them and the split put them in
    #: different cells: separate Parameters now (the head's a copy), which the tied-weights
    #: option keeps equal. ``None`` when the model does not tie them.
    tied_weights: tuple[str, str] | None
    family: str  #: ``config.model_type``: ``llama``, ``qwen2`` or ``qwen2_vl``
    config: Any = None  #: the model's transformers config (written by an export)
    #: This rank's pipeline rank and the pipeline's size: set by
    #: :func:`graph_exec.models.load_split`; a whole-model ``split_model`` holds everything (0 of 1).
    rank: int = 0
    pp: int = 1
    #: ``{parameter name: its Hugging Face name in a pretrained file}`` of every parameter of the
    #: whole model, each once (a tied pair under the embedding's name): what an export writes.
    checkpoint_names: dict[str, str] | None = None
    #: The model's parameters no cell holds (buffers the chunks recompute, such as Qwen2-VL's
    #: rotary ``inv_freq``): pipeline rank 0 loads and exports them, so an export is complete.
    unplaced: dict[str, Parameter] = field(default_factory=dict)
    #: The whole model the split was cut from (after :func:`load_split`, a skeleton whose other
    #: ranks' parameters have no data): what ``vlm_inputs`` reads the M-RoPE index code from.
    model: Any = None
    #: The pretrained directory :func:`load_split` read (``None`` from a config): an export
    #: carries its files that are not weights (tokenizer, processor, chat template) over.
    source: Path | None = None


def family_of(model: Any) -> Family:
    """The :class:`Family` of a mindone model, or ``TypeError`` naming the supported ones."""
    model_type = model_type_of(getattr(model, "config", None))
    family = FAMILIES.get(model_type)
    if family is None or not hasattr(model, "lm_head"):
        raise TypeError(
            f"split_model takes a mindone.transformers LlamaForCausalLM, Qwen2ForCausalLM or "
            f"Qwen2VLForConditionalGeneration; got {type(model).__name__} (model_type {model_type!r})"
        )
    return family


def _check_layers(layers: Sequence[int] | None, num_layers: int, num_stages: int) -> tuple[int, ...]:
    if layers is None:
        if num_layers < num_stages:
            raise ValueError(
                f"the model has {num_layers} decoder layers, fewer than num_stages={num_stages}: pass "
                "layers= with some stages at 0, or use fewer stages"
            )
        return even_layers(num_layers, num_stages)
    counts = tuple(layers)
    if len(counts) != num_stages or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts
    ):
        raise ValueError(f"layers must be {num_stages} integers >= 0, one per stage, got {list(counts)}")
    if sum(counts) != num_layers:
        raise ValueError(
            f"layers {list(counts)} add up to {sum(counts)}, but the model has {num_layers} decoder layers"
        )
    return counts


def split_model(
    model: Any,
    num_stages: int,
    *,
    layers: Sequence[int] | None = None,
    preprocess: str | None = None,
    trainable_preprocess: bool | None = None,
    image_grid: tuple[int, int, int] | None = None,
    packed: bool = False,
) -> SplitModel:
    """Cut ``model`` into a preprocess and ``num_stages`` chunks (stage ``s`` on rank ``s mod P``).

    Args:
        model: a mindone ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
            ``Qwen2VLForConditionalGeneration`` (``attn_implementation="eager"`` on CPU).
        num_stages: ``P × V`` chunks.
        layers: decoder layers per stage (default: as even as possible); see
            :func:`graph_exec.models.rebalanced_layers` (from :mod:`graph_exec.balance`) for a split that evens the ranks' loads.
        preprocess: ``"vision"`` (Qwen2-VL, the default there: vision tower + merger), or for a
            language model ``"embedding"`` (the default: the token embedding, transposed by MPipe)
            or ``"none"`` (the embedding stays in stage 0; dataload only).
        trainable_preprocess: train the preprocess (default: the embedding yes, the vision tower
            no). ``False`` sets ``requires_grad=False`` on its parameters.
        image_grid: Qwen2-VL only: the ``(t, h, w)`` patch grid of every image (``image_grid_thw``
            of one image) when every sample carries one image of this grid (batches from
            :func:`graph_exec.models.vlm_inputs`). ``None`` (the default): samples of any
            images, 0..k each, each its own size, and any text lengths, padded with a mask
            (batches from :func:`graph_exec.models.vlm_batch`; the padding mask travels with
            the hidden states, see :class:`~graph_exec.models.chunks.MaskedDecoderChunk`).
        packed: Llama/Qwen2: take ``(input_ids, position_ids, attention_mask)`` with segment ids
            in the mask, for packed rows (:func:`graph_exec.models.text_packed_micro_batches`):
            each sample attends only to itself. (A Qwen2-VL split without ``image_grid`` takes
            packed rows as they are.)

    Stage inputs and outputs: see :mod:`graph_exec.models.chunks`; batches are made by
    :func:`graph_exec.models.lm_inputs` / :func:`graph_exec.models.vlm_inputs`.
    """
    family = family_of(model)
    vlm = family.model_type == "qwen2_vl"
    kind = _checked_kind(family.model_type, num_stages, preprocess, image_grid, packed)
    cpu_ops.adopt(model)
    file_names = {name: names[0] for name, names in checkpoint_names(model).items()}
    names = {id(p): p.name for p in model.get_parameters()}
    decoder = model.model.language_model if vlm else model.model
    blocks = list(decoder.layers)
    counts = _check_layers(layers, len(blocks), num_stages)
    embed, head = decoder.embed_tokens, model.lm_head
    tied = _untie_if_apart(embed, head, kind != "none" or num_stages > 1, names)
    # Qwen2-VL's own rotary embedding does not compile (see MultimodalRotary).
    rotary = MultimodalRotary(decoder.rotary_emb) if vlm else decoder.rotary_emb
    image_token = model.config.image_token_id if vlm else None

    padded = (vlm and image_grid is None) or packed
    pre, transpose_layers = _preprocess(kind, model, embed, padded, packed, image_grid)
    if pre is not None and not ((not vlm) if trainable_preprocess is None else trainable_preprocess):
        _freeze(pre)

    chunk = MaskedDecoderChunk if padded else DecoderChunk
    stages = _stage_chunks(
        chunk,
        family,
        decoder,
        blocks,
        counts,
        rotary,
        first_embed=embed if kind != "embedding" else None,
        image_token=image_token,
        head=head,
    )
    unplaced = _keep_names(model, names, [*stages, *([pre] if pre is not None else [])])
    return SplitModel(
        pre,
        transpose_layers,
        stages,
        counts,
        tied,
        family.model_type,
        model.config,
        checkpoint_names=file_names,
        unplaced=unplaced,
        model=model,
    )


def _untie_if_apart(embed: Any, head: Any, apart: bool, names: dict[int, str]) -> tuple[str, str] | None:
    """Untie a shared embedding and head when they end up in different cells (``apart``), the
    head's copy named in ``names``; the ``(embedding, head)`` names of the pair, else ``None``."""
    if not (_shares_weight(embed, head) and apart):
        return None
    tied = _untie(embed, head)
    names[id(head.weight)] = tied[1]
    return tied


def _freeze(cell: Any) -> None:
    """A preprocess that is not trained: no gradients for its parameters."""
    for param in cell.get_parameters():
        param.requires_grad = False


def _stage_chunks(
    chunk: type,
    family: Any,
    decoder: Any,
    blocks: list,
    counts: Sequence[int],
    rotary: Any,
    *,
    first_embed: Any,
    image_token: int | None,
    head: Any,
) -> list:
    """One ``chunk`` per stage over its ``counts`` of ``blocks``: the first stage holds the
    embedding unless the preprocess does (``first_embed``), the last the final norm and head."""
    stages, start = [], 0
    for s, count in enumerate(counts):
        last = s == len(counts) - 1
        stages.append(
            chunk(
                family,
                blocks[start : start + count],
                rotary,
                decoder.norm.weight.dtype,
                embed=first_embed if s == 0 else None,
                image_token_id=image_token if s == 0 else None,
                norm=decoder.norm if last else None,
                head=head if last else None,
            )
        )
        start += count
    return stages


def _keep_names(model: Any, names: dict[int, str], cells: list) -> dict[str, Any]:
    """Give the parameters of ``cells`` their names in the whole model (so checkpoints and
    optimizers see the same names on every split); return the model's parameters no cell holds."""
    placed = set()
    for cell in cells:
        for param in cell.get_parameters():
            param.name = names.get(id(param), param.name)
            placed.add(id(param))
    return {names[id(p)]: p for p in model.get_parameters() if id(p) not in placed}


def _checked_kind(
    model_type: str,
    num_stages: Any,
    preprocess: str | None,
    image_grid: tuple[int, int, int] | None,
    packed: bool,
) -> str:
    """The preprocess kind of the split, after every check of :func:`split_model`'s arguments."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    vlm = model_type == "qwen2_vl"
    kind = preprocess or ("vision" if vlm else "embedding")
    allowed = ("vision",) if vlm else ("embedding", "none")
    if kind not in allowed:
        raise ValueError(f"preprocess={preprocess!r} for {model_type}; choose one of {allowed}")
    if vlm and image_grid is not None and (len(image_grid) != 3 or any(int(n) < 1 for n in image_grid)):
        raise ValueError(
            f"image_grid must be (t, h, w), the patch grid of every image, or None (any images); got {image_grid!r}"
        )
    if not vlm and image_grid is not None:
        raise ValueError("image_grid applies to Qwen2-VL only")
    if packed and vlm and image_grid is not None:
        raise ValueError("packed rows need a Qwen2-VL split without image_grid (any images per row)")
    return kind


def _preprocess(
    kind: str, model: Any, embed: nn.Cell, padded: bool, packed: bool, image_grid: tuple[int, int, int] | None
) -> tuple[nn.Cell | None, int]:
    """The preprocess cell of ``kind`` and its layer count (``None, 0`` for ``"none"``)."""
    if kind == "vision":
        visual = model.model.visual
        pre = VisionBatchPreprocess(visual) if padded else _vision(visual, tuple(int(n) for n in image_grid))
        return pre, len(pre.blocks) + 2  # patch embedding, the blocks, the merger
    if kind == "embedding":
        return (MaskedEmbeddingPreprocess if packed else EmbeddingPreprocess)(embed), 1
    return None, 0


def _vision(visual: nn.Cell, grid: tuple[int, int, int]) -> VisionPreprocess:
    merge = visual.spatial_merge_size
    if grid[1] % merge or grid[2] % merge:
        raise ValueError(f"image_grid {grid}: h and w must be multiples of spatial_merge_size {merge}")
    return VisionPreprocess(visual, grid)


def _embedding_weight(embed: nn.Cell) -> Parameter:
    return embed.weight if hasattr(embed, "weight") else embed.embedding_table  # mint.nn / nn.Embedding


def _shares_weight(embed: nn.Cell, head: nn.Cell) -> bool:
    return head.weight is _embedding_weight(embed)


def _untie(embed: nn.Cell, head: nn.Cell) -> tuple[str, str]:
    """Give the head its own copy of the weight it shares with the embedding (the two are in
    different cells, possibly on different ranks); returns the pair's names."""
    weight = _embedding_weight(embed)
    if weight.has_init:  # built under no_init_parameters: the copy stays an initializer too
        with no_init_parameters():
            copy = Parameter(initializer(weight.init, weight.shape, weight.dtype))
    else:
        copy = Parameter(weight.value().copy())
    copy.name, copy.requires_grad = "lm_head.weight", weight.requires_grad
    head.weight = copy
    return weight.name, "lm_head.weight"
