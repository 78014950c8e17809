"""A Hugging Face-format pretrained directory: its config, its shards, and the names inside.

A ``save_pretrained`` directory holds ``config.json`` and either one ``model.safetensors`` or
several shards listed by ``model.safetensors.index.json`` (``weight_map``: tensor name → file).
:class:`PretrainedDirectory` reads only the headers when it opens one (names, shapes, dtypes),
so every rank can check the whole directory against the model before anything is read or any
rank communicates, and then reads single tensors on demand, each straight from its byte range
in the shard into its array: a rank touches only the bytes of the tensors it holds.

Names. A parameter's name in the mindone model is not always its name in the file: for the
vision-language models mindone's ``save_pretrained`` writes the legacy Hugging Face layout
(``model.language_model.layers.0…`` is stored as ``model.layers.0…``, ``model.visual…`` as
``visual…``), reversing the class's ``_checkpoint_conversion_mapping``, and ``from_pretrained``
maps them forward again. :func:`checkpoint_names` applies the same reversal, so a directory
written by mindone (or by PyTorch ``transformers``) is read under the names it has, and an
export writes the names a ``from_pretrained`` of either library expects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

#: ``config.model_type`` → the mindone class ``split_model`` cuts.
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: safetensors' dtype names → numpy's (the dtypes the ``"np"`` framework reads).
NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
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


class PretrainedDirectory:
    """The shards of a pretrained directory, headers read, tensors read on demand.

    Raises ``FileNotFoundError`` for a directory without weights or with a shard the index names
    that is not there, ``ValueError`` for an index that names a tensor its shard does not hold.
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        elif (self.path / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(
                f"{str(self.path)!r} holds no weights: neither {INDEX_FILE} nor {SINGLE_FILE}"
            )
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        missing = [name for name in files if not (self.path / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{str(self.path)!r} is missing shard(s) {missing} named by its {INDEX_FILE}"
            )
        #: tensor name → (file, shape, safetensors dtype)
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
        #: tensor name → (first byte, end) of its data in its file (see :meth:`read`)
        self._spans: dict[str, tuple[int, int]] = {}
        for name in files:
            with safe_open(str(self.path / name), framework="np") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    piece = handle.get_slice(key)
                    self.tensors[key] = (name, tuple(piece.get_shape()), piece.get_dtype())
            self._spans.update(_data_spans(self.path / name))
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self.tensors.get(k, (f,))[0] != f)
            if absent:
                raise ValueError(
                    f"{INDEX_FILE} of {str(self.path)!r} names tensors their shard does not hold: "
                    f"{absent[:5]}{' …' if len(absent) > 5 else ''}"
                )

    def resolve(self, expected: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]) -> dict[str, str]:
        """``{parameter: the tensor here that holds it}`` for ``{parameter: (candidate names,
        shape)}`` (the first candidate present wins). ``ValueError`` naming the first few
        missing or mismatched tensors, before anything is read."""
        found = {
            name: next((c for c in names if c in self.tensors), None) for name, (names, _) in expected.items()
        }
        missing = sorted(expected[name][0][0] for name, key in found.items() if key is None)
        if missing:
            raise ValueError(
                f"{str(self.path)!r} lacks {len(missing)} tensor(s) the model needs: "
                f"{missing[:5]}{' …' if len(missing) > 5 else ''}"
            )
        wrong = [
            f"{key}: {list(self.tensors[key][1])} in the file, {list(expected[name][1])} from the config"
            for name, key in found.items()
            if self.tensors[key][1] != tuple(expected[name][1])
        ]
        if wrong:
            raise ValueError(
                f"{str(self.path)!r} holds tensors whose shape differs from the config: "
                + "; ".join(wrong[:3])
                + (" …" if len(wrong) > 3 else "")
            )
        unsupported = sorted({self.tensors[key][2] for key in found.values()} - set(NUMPY_DTYPES))
        if unsupported:
            raise ValueError(
                f"{str(self.path)!r} stores dtype(s) {unsupported}, which numpy cannot hold; supported: "
                f"{', '.join(NUMPY_DTYPES)}"
            )
        return found  # type: ignore[return-value]

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``, read from its shard (only its own bytes) straight into a fresh array:
        the rank's peak memory holds the tensor once. (``safe_open``'s ``get_tensor`` maps the
        file and copies out of the mapping, and the mapped pages count in the process's
        resident memory beside the copy: twice the tensor, measured, at the moment of the read.)
        The shard was checked by ``safe_open`` when the directory was opened; ``ValueError``
        for a file that ends before the tensor does."""
        file, shape, dtype = self.tensors[name]
        start, end = self._spans[name]
        array = np.empty(shape, dtype=np.dtype(NUMPY_DTYPES[dtype]).newbyteorder("<"))
        with open(self.path / file, "rb", buffering=0) as handle:
            handle.seek(start)
            got = handle.readinto(memoryview(array.reshape(-1)).cast("B")) if array.size else 0
        if got != end - start or array.nbytes != end - start:
            raise ValueError(
                f"{str(self.path / file)!r} holds {got} of the {end - start} bytes of tensor {name!r} "
                f"({dtype} {list(shape)}: {array.nbytes} bytes)"
            )
        return array


def _data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """``{tensor: (first byte, end)}`` in the file ``path``, from its safetensors header (an
    8-byte little-endian length, then that many bytes of JSON whose ``data_offsets`` count from
    the end of the header)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    base = 8 + length
    return {
        key: (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        for key, entry in header.items()
        if key != "__metadata__"
    }
