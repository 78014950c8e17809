"""A real model's sizes from its ``config.json`` alone: parameters per piece as
:func:`graph_exec.models.split_model` cuts the model, and what a decoder layer's tape keeps.

``graph-exec tune --config`` prices a 72 B model on a laptop: nothing here imports MindSpore or
transformers, and no parameter is built. The counts are the mindone classes' own shapes written
out per family (``tests/unit/test_config_sizes.py`` checks them, parameter by parameter, against
the models built unallocated under ``no_init_parameters``, the 72 B Qwen2-VL included).

What a decoder layer keeps for its backward (its tape) is a calibrated formula, per micro-batch
of ``b`` rows of ``s`` tokens, in the compute dtype's ``e`` bytes::

    tape(layer) = e · b · s · (A · h + C · i + D · heads · s)

``h`` the hidden size, ``i`` the MLP width, ``heads`` the attention heads (eager attention keeps
its ``heads × s × s`` probabilities; a fused "flash" kernel does not: D = 0 there). :data:`TAPE_COEFFICIENTS` were fitted on
measured tapes of small Qwen2 layers in float32 (``python -m graph_exec.harness.tape_fit``;
docs/memory.md has the fit and ``tests/runtime/test_tape_formula.py`` the check at two widths
and two lengths); other dtypes scale by ``e``, taken to be the dtype the tape holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graph_exec.balance import even_layers
from graph_exec.cost_file import ModelCosts

#: ``config.model_type`` values whose mindone class :func:`split_model` cuts.
FAMILIES = ("llama", "qwen2", "qwen2_vl")

#: Bytes per element of the dtypes ``--dtype`` takes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: ``(A, C, D)`` of the tape formula (see the module docstring), in elements per token.
TAPE_COEFFICIENTS = (12.6, 3.9, 1.1)


class ConfigError(ValueError):
    """A config the sizes cannot be read from: unreadable, of an unknown family, or lacking a size."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one decoder model (and, for Qwen2-VL, its vision tower) a config names."""

    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  #: the head shares the embedding's weight (the split gives the head a copy)
    attention_bias: bool  #: q/k/v projections have biases (Qwen2: always; Llama: its option)
    output_bias: bool  #: o_proj has a bias (Llama's ``attention_bias``)
    mlp_bias: bool
    vision_depth: int = 0
    vision_width: int = 0  #: the vision blocks' ``embed_dim``
    vision_heads: int = 0
    vision_mlp_ratio: float = 0.0
    vision_in: int = 0  #: input channels × temporal patch × patch × patch (one patch's values)
    merge: int = 1  #: spatial_merge_size

    @property
    def vision(self) -> bool:
        return self.family == "qwen2_vl"


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of ``path`` (a ``config.json`` or the directory holding one)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the model config {str(file)!r}: {exc}") from exc
    if not isinstance(entries, dict):
        raise ConfigError(f"the model config {str(file)!r} must hold one JSON object")
    return entries


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The sizes in ``config`` (a ``config.json``'s object, flat or with a ``text_config``)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"model_type {family!r} is not a family the split knows; choose one of {', '.join(FAMILIES)}"
        )
    text = {**config, **config.get("text_config", {})} if family == "qwen2_vl" else config
    hidden, heads = _int(text, "hidden_size"), _int(text, "num_attention_heads")
    llama = family == "llama"
    shape = dict(
        family=family,
        hidden=hidden,
        intermediate=_int(text, "intermediate_size"),
        layers=_int(text, "num_hidden_layers"),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads) if llama else hidden // heads,
        vocab=_int(text, "vocab_size"),
        tied=bool(text.get("tie_word_embeddings", False)),
        attention_bias=bool(text.get("attention_bias", False)) if llama else True,
        output_bias=bool(text.get("attention_bias", False)) if llama else False,
        mlp_bias=bool(text.get("mlp_bias", False)) if llama else False,
    )
    if family == "qwen2_vl":
        vision = config.get("vision_config") or {}
        width = int(vision.get("embed_dim", 1280))
        shape.update(
            vision_depth=int(vision.get("depth", 32)),
            vision_width=width,
            vision_heads=int(vision.get("num_heads", 16)),
            vision_mlp_ratio=float(vision.get("mlp_ratio", 4)),
            vision_in=int(vision.get("in_channels", vision.get("in_chans", 3)))
            * int(vision.get("temporal_patch_size", 2))
            * int(vision.get("patch_size", 14)) ** 2,
            merge=int(vision.get("spatial_merge_size", 2)),
        )
    return ModelShape(**shape)


def _int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"the config's {key!r} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ParamCounts:
    """Elements of each piece the split places (``buffers``: non-trainable, e.g. ``inv_freq``)."""

    embedding: int
    layer: int  #: one decoder layer's trainable parameters
    layer_buffers: int  #: one decoder layer's buffers (Qwen2-VL: its attention's ``inv_freq``)
    final: int  #: the final norm and the head (the head's own copy when tied)
    vision: int  #: the vision tower and merger (the preprocess of Qwen2-VL)
    unplaced: int  #: buffers no cell holds (rank 0 keeps them)
    layers: int
    tied_copy: bool = False  #: ``final`` includes the head's copy of the tied embedding

    @property
    def total(self) -> int:
        """Every element the unsplit model holds (a tied head counted once)."""
        return self.split_total - (self.embedding if self.tied_copy else 0)

    @property
    def split_total(self) -> int:
        return (
            self.embedding
            + self.layers * (self.layer + self.layer_buffers)
            + self.final
            + self.vision
            + self.unplaced
        )


def param_counts(shape: ModelShape) -> ParamCounts:
    """Elements per piece, as mindone's classes shape them."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h
    attention += (q + 2 * kv) * shape.attention_bias + h * shape.output_bias
    mlp = 3 * h * shape.intermediate + (2 * shape.intermediate + h) * shape.mlp_bias
    vision = unplaced = layer_buffers = 0
    if shape.vision:
        layer_buffers = shape.head_dim // 2  # each attention's rotary inv_freq
        unplaced = shape.head_dim // 2 + shape.vision_width // shape.vision_heads // 4
        vision = _vision_params(shape)
    return ParamCounts(
        embedding=shape.vocab * h,
        layer=attention + mlp + 2 * h,  # and the two RMSNorm weights
        layer_buffers=layer_buffers,
        final=h + shape.vocab * h,  # the norm and the head (a copy when tied)
        vision=vision,
        unplaced=unplaced,
        layers=shape.layers,
        tied_copy=shape.tied,
    )


def _vision_params(shape: ModelShape) -> int:
    w, inner = shape.vision_width, int(shape.vision_width * shape.vision_mlp_ratio)
    block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * inner + inner) + (inner * w + w)
    merged = w * shape.merge**2
    merger = 2 * w + (merged * merged + merged) + (merged * shape.hidden + shape.hidden)
    return shape.vision_in * w + shape.vision_depth * block + merger


def stage_params(shape: ModelShape, num_stages: int, layers: tuple[int, ...] | None = None) -> list[int]:
    """Elements of each of ``num_stages`` chunks as :func:`split_model` cuts them (default
    preprocess: the embedding for a language model, the vision tower for Qwen2-VL, which then
    leaves the embedding in stage 0)."""
    counts = param_counts(shape)
    layers = layers or even_layers(shape.layers, num_stages)
    out = [n * (counts.layer + counts.layer_buffers) for n in layers]
    if shape.vision:
        out[0] += counts.embedding
    out[-1] += counts.final
    return out


def preprocess_params(shape: ModelShape) -> int:
    """Elements of the preprocess :func:`split_model` makes by default."""
    counts = param_counts(shape)
    return counts.vision if shape.vision else counts.embedding


def layer_tape_bytes(shape: ModelShape, rows: int, seq: int, dtype_bytes: int, flash: bool = False) -> int:
    """What one decoder layer's tape keeps for a micro-batch (the module docstring's formula;
    ``flash``: a fused attention kernel, which keeps no ``heads × s × s`` probabilities, D = 0)."""
    a, c, d = TAPE_COEFFICIENTS
    d = 0.0 if flash else d
    per_token = a * shape.hidden + c * shape.intermediate + d * shape.heads * seq
    return round(dtype_bytes * rows * seq * per_token)


@dataclass(frozen=True)
class Workload:
    """What one row of a micro-batch is: ``seq`` tokens, ``image_tokens`` of them from the
    vision tower (Qwen2-VL), parameters and activations in ``dtype``; ``attention``: ``"eager"``
    (what the split runs on CPU, keeping the attention probabilities) or ``"flash"``."""

    seq: int = 4096
    image_tokens: int = 1024
    dtype: str = "bfloat16"
    attention: str = "eager"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.attention not in ("eager", "flash"):
            raise ConfigError(f"attention {self.attention!r} is not one of eager, flash")
        if self.seq < 1 or not 0 <= self.image_tokens <= self.seq:
            raise ConfigError(
                f"image_tokens must be in 0 … seq (image tokens are part of the sequence), got image_tokens={self.image_tokens}, seq={self.seq}"
            )


def config_costs(shape: ModelShape, work: Workload) -> ModelCosts:
    """The :class:`~graph_exec.cost_file.ModelCosts` of ``shape`` per row of ``work``: every
    size, no time (a real model's step time needs a measurement at its size; the planner then
    orders plans by their peak alone). Parameters in ``work.dtype``; gradients accumulate in
    float32 (as the schedules do); Adam's two float32 moments, and a float32 master copy of
    every parameter that is not float32, are the optimizer state."""
    e = DTYPE_BYTES[work.dtype]
    counts = param_counts(shape)
    positions = 4 * work.seq * (3 if shape.vision else 1)  # int32 position ids travel beside
    hidden = e * work.seq * shape.hidden
    master = 0 if e == 4 else 4
    common = dict(
        layers=shape.layers,
        micro_batch_size=1,
        layer_forward=0.0,
        layer_backward=0.0,
        layer_activation_bytes=layer_tape_bytes(shape, 1, work.seq, e, work.attention == "flash"),
        layer_param_bytes=e * (counts.layer + counts.layer_buffers),
        hidden_bytes=hidden + positions,
        last_stage_param_bytes=e * counts.final,
        last_stage_activation_bytes=(e + 4) * work.seq * shape.vocab,  # logits, float32 loss gradient
        optimizer_bytes_per_param_byte=(8 + master) / e,
        gradient_bytes_per_param_byte=4 / e,
    )
    if shape.vision:  # the frozen vision tower is the preprocess; the embedding stays in stage 0
        return ModelCosts(
            **common,
            preprocess="frozen",
            preprocess_output_bytes=e * work.image_tokens * shape.hidden,
            preprocess_param_bytes=e * counts.vision,
            first_stage_param_bytes=e * (counts.embedding + counts.unplaced),
        )
    return ModelCosts(  # the trainable embedding is the preprocess (MPipe transposes it)
        **common,
        preprocess="trainable",
        preprocess_output_bytes=hidden,
        preprocess_tape_bytes=hidden,
        preprocess_param_bytes=e * counts.embedding,
    )
