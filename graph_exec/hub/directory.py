"""A Hugging Face ``save_pretrained`` directory's files: shards, index, headers; tensors by byte range.

A ``save_pretrained`` directory holds ``config.json`` and either one ``model.safetensors`` or
several shards listed by ``model.safetensors.index.json`` (``weight_map``: tensor name → file).
:class:`PretrainedDirectory` reads only the headers when it opens one (names, shapes, dtypes),
so every rank can check the whole directory against the model before anything is read or any
rank communicates, and then reads single tensors on demand, each straight from its byte range
in the shard into its array: a rank touches only the bytes of the tensors it holds. No
MindSpore here: ``graph-exec run`` checks a directory with it before the launch
(:func:`check_directory`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from graph_exec.hub.dtypes import LOAD_CHOICES, STORED_DTYPES, check_readable, read_widened

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def check_directory(path: str | Path, model_types: Iterable[str]) -> str:
    """The ``model_type`` of the pretrained directory ``path``, after checking what can be
    checked without building the model: ``config.json`` names one of ``model_types``, every
    shard the index names is there and holds the tensors the index says, and every tensor's
    dtype is one the reader knows. ``FileNotFoundError``/``ValueError`` naming what is wrong."""
    folder = Path(path)
    known = ", ".join(model_types)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{str(folder)!r} is not a pretrained directory: it has no config.json"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(folder / 'config.json')!r} is not JSON: {exc}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type is None:
        raise ValueError(f"{str(folder / 'config.json')!r} names no model_type; the models known: {known}")
    if model_type not in model_types:
        raise ValueError(
            f"{str(folder / 'config.json')!r} holds model_type {model_type!r}; the models known: {known}"
        )
    shards = PretrainedDirectory(folder)
    for name, (file, _, dtype) in shards.tensors.items():
        check_readable(name, dtype, repr(str(folder / file)))
    return model_type


class PretrainedDirectory:
    """The shards of a pretrained directory, headers read, tensors read on demand.

    Raises ``FileNotFoundError`` for a directory without weights or with a shard the index names
    that is not there, ``ValueError`` for an index that names a tensor its shard does not hold
    and for a shard safetensors refuses (cut short, a bad header).
    """

    def __init__(self, path: str | Path) -> None:
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
            self.tensors.update(_headers(self.path / name))
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
        for key in found.values():
            check_readable(key, self.tensors[key][2], repr(str(self.path)))
        return found  # type: ignore[return-value]

    def read(self, name: str, dtype: str = "float32") -> np.ndarray:
        """Tensor ``name``, read from its shard (only its own bytes) straight into a fresh array:
        the rank's peak memory holds the tensor once. (``safe_open``'s ``get_tensor`` maps the
        file and copies out of the mapping, and the mapped pages count in the process's
        resident memory beside the copy: twice the tensor, measured, at the moment of the read.)

        ``dtype="float32"``: a BF16 or F16 tensor widened to its exact float32 values (in place,
        :func:`~graph_exec.models.dtypes.read_widened`); ``"stored"``: the file's own dtype, a
        BF16 tensor as its ``uint16`` bits. Other dtypes are returned as stored either way.
        ``ValueError`` for a dtype this reader does not know and for a file that ends before the
        tensor does (the shard was checked by ``safe_open`` when the directory was opened)."""
        if dtype not in LOAD_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(LOAD_CHOICES)}, got {dtype!r}")
        file, shape, stored = self.tensors[name]
        check_readable(name, stored, repr(str(self.path / file)))
        start, end = self._spans[name]
        with open(self.path / file, "rb", buffering=0) as handle:
            handle.seek(start)
            if dtype == "float32" and stored in ("BF16", "F16"):
                array, got = read_widened(handle, shape, stored)
                size = array.size * 2
            else:
                array = np.empty(shape, dtype=np.dtype(STORED_DTYPES[stored]).newbyteorder("<"))
                got = handle.readinto(memoryview(array.reshape(-1)).cast("B")) if array.size else 0
                size = array.nbytes
        if got != end - start or size != end - start:
            raise ValueError(
                f"{str(self.path / file)!r} holds {got} of the {end - start} bytes of tensor {name!r} "
                f"({stored} {list(shape)}: {size} bytes)"
            )
        return array


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``{tensor: (file name, shape, dtype)}`` of the shard ``path``, checked whole by
    safetensors' ``safe_open``; ``ValueError`` naming the file for one it refuses."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(str(path), framework="np") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                piece = handle.get_slice(key)
                out[key] = (path.name, tuple(piece.get_shape()), piece.get_dtype())
    except Exception as exc:  # safetensors' own error type, whatever its version calls it
        raise ValueError(f"{str(path)!r} is not a safetensors file safetensors can read: {exc}") from None
    return out


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
