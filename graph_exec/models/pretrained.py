"""A Hugging Face-format pretrained directory as a model: its config, its class, the names inside.

The files themselves (shards, index, headers, dtypes) are :mod:`graph_exec.hub`'s, which needs
no MindSpore, so the CLI checks a directory before the launch with the same code every rank
runs (:class:`~graph_exec.hub.directory.PretrainedDirectory`).

Names. A parameter's name in the mindone model is not always its name in the file: for the
vision-language models mindone's ``save_pretrained`` writes the legacy Hugging Face layout
(``model.language_model.layers.0…`` is stored as ``model.layers.0…``, ``model.visual…`` as
``visual…``), reversing the class's ``_checkpoint_conversion_mapping``, and ``from_pretrained``
maps them forward again. :func:`checkpoint_names` applies the same reversal, so a directory
written by mindone (or by PyTorch ``transformers``) is read under the names it has, and an
export writes the names a ``from_pretrained`` of either library expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: ``config.model_type`` → the mindone class ``split_model`` cuts.
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}


def model_type_of(config: Any) -> str | None:
    """``config``'s model type: the class's (a Qwen2-VL config read from a directory reports its
    text part's ``qwen2_vl_text`` on the instance), else the instance's."""
    return getattr(type(config), "model_type", None) or getattr(config, "model_type", None)


def model_class(config: Any) -> type:
    """The mindone class of ``config``'s model type; ``TypeError`` names the families the split
    knows."""
    from graph_exec.models import mindone

    model_type = model_type_of(config)
    if model_type not in MODEL_CLASSES:
        raise TypeError(
            f"model_type {model_type!r} is not a family the split knows; choose one of "
            f"{', '.join(MODEL_CLASSES)} ({', '.join(MODEL_CLASSES.values())})"
        )
    return getattr(mindone(), MODEL_CLASSES[model_type])


def load_config(path: str | Path, attn_implementation: str = "eager") -> Any:
    """The transformers config of the pretrained directory ``path`` (read offline)."""
    from graph_exec.models.quiet import quiet_imports

    with quiet_imports():
        from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a pretrained directory: it has no config.json")
    return AutoConfig.from_pretrained(str(folder), attn_implementation=attn_implementation)


def _uses_legacy_names(cls: type) -> bool:
    """Whether mindone's ``save_pretrained`` reverses the class's key mapping (its VLM list)."""
    from mindone.transformers.modeling_utils import VLMS

    return any(allowed in klass.__name__.lower() for klass in cls.__mro__[:-1] for allowed in VLMS)


def torch_names(model: Any) -> dict[str, str]:
    """``{parameter name: its PyTorch (Hugging Face) name}`` of every parameter of ``model``,
    each once: the inverse of mindone's own renaming (``embedding_table`` of an ``nn.Embedding``
    is ``weight``, a LayerNorm's ``gamma``/``beta`` are ``weight``/``bias``)."""
    from mindone.transformers.modeling_utils import _get_pt2ms_mappings

    inverse = {ms_name: pt_name for pt_name, (ms_name, _) in _get_pt2ms_mappings(model).items() if ms_name}
    params = {id(p): p.name for p in model.get_parameters()}  # a tied pair once
    return {name: inverse.get(name, name) for name in params.values()}


def legacy_names(cls: type, names: Iterable[str]) -> dict[str, str]:
    """``{name: name in a save_pretrained file}``: the key renaming mindone's (and PyTorch
    transformers') ``save_pretrained`` applies for a vision-language class (the reverse of its
    ``_checkpoint_conversion_mapping``, the first pattern that matches wins); identity otherwise."""
    mapping = getattr(cls, "_checkpoint_conversion_mapping", None) or {}
    if not mapping or not _uses_legacy_names(cls):
        return {name: name for name in names}
    reverse = [(model, re.sub(r"\(.*\)", "", stored.lstrip("^"))) for stored, model in mapping.items()]
    out = {}
    for name in names:
        key = name
        for pattern, replacement in reverse:
            key, count = re.subn(pattern, replacement, key)
            if count:
                break
        out[name] = key
    return out


def checkpoint_names(model: Any) -> dict[str, tuple[str, ...]]:
    """``{parameter name: the names it may have in a pretrained file}``, each parameter once, the
    Hugging Face name first (what an export writes and PyTorch ``transformers`` reads), then the
    name mindone's own ``save_pretrained`` writes (it keeps ``embedding_table``)."""
    cls = type(model)
    torch = torch_names(model)
    hf = legacy_names(cls, torch.values())
    native = legacy_names(cls, torch)
    return {name: tuple(dict.fromkeys((hf[pt], native[name], name))) for name, pt in torch.items()}
