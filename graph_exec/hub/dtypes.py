"""The dtypes of safetensors shards, read and written exactly, with numpy alone.

numpy has no bfloat16, so safetensors' numpy reader refuses BF16 shards (the dtype of nearly
every Llama, Qwen2 and Qwen2-VL on the Hub) and its writer cannot write them. The format needs
neither: an 8-byte little-endian header length, a JSON header (``dtype``, ``shape``,
``data_offsets`` per tensor), then the raw bytes. A BF16 value is the upper half of a float32
one, so its bits (held here as ``uint16``) widen to float32 exactly by a shift, and a float32
narrows to BF16 by rounding its bits to nearest, ties to even.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

#: safetensors' dtype → the numpy dtype that holds its bytes (BF16: its bits, as uint16).
STORED_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
#: The names ``torch_dtype`` / ``--export-dtype`` use → safetensors' dtype.
FLOAT_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
#: ``load_split``'s choices: ``float32`` widens BF16/F16 exactly, ``stored`` keeps the file's dtype.
LOAD_CHOICES = ("float32", "stored")
#: Elements widened per pass (see :func:`read_widened`): about 3 MiB of scratch, whatever the tensor.
_CHUNK = 1 << 18


def check_readable(tensor: str, dtype: str, where: str) -> None:
    """``ValueError`` naming ``tensor``, its ``dtype`` and the dtypes this reader knows."""
    if dtype not in STORED_DTYPES:
        raise ValueError(
            f"{where}: tensor {tensor!r} is stored as {dtype}, which cannot be read; readable: "
            f"{', '.join(STORED_DTYPES)}"
        )


def stored_name(name: str | None, what: str) -> str:
    """safetensors' dtype of ``float32``/``bfloat16``/``float16`` (``torch.`` prefix allowed);
    ``ValueError`` naming ``what`` and the choices for anything else."""
    key = str(name).removeprefix("torch.")
    if key not in FLOAT_NAMES:
        raise ValueError(
            f"{what} {name!r} is not a dtype an export writes; choose one of {', '.join(FLOAT_NAMES)}"
        )
    return FLOAT_NAMES[key]


def config_dtype(config: Any) -> str:
    """safetensors' dtype of the checkpoint ``config`` describes (its ``torch_dtype``, which
    transformers keeps as ``dtype``); float32 when it names none."""
    value = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    return "F32" if value is None else stored_name(value, "the config's torch_dtype")


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """The exact float32 values of BF16 ``bits`` (a new array)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """BF16 bits of float32 ``values``, rounded to nearest, ties to even (as PyTorch's ``.to``);
    a NaN stays a NaN of its sign (rounding its bits could carry it into infinity)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) & np.uint32(0x8000)).astype(np.uint16) | np.uint16(0x7FC0)
    return rounded


def read_widened(handle: BinaryIO, shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, int]:
    """A BF16 or F16 tensor read from ``handle`` (at its first byte) as exact float32, with no
    copy of the whole tensor beside the result: the raw bytes are read into the upper half of
    the float32 array, then widened front to back a chunk at a time (output ``i`` fills bytes
    ``4i…4i+3``, its source sits at ``2n+2i``: a chunk never overwrites a source still unread).
    Returns the array and the number of bytes read (short for a file cut short)."""
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    halves = flat.view(np.uint16)
    n = flat.size
    got = handle.readinto(memoryview(halves[n:]).cast("B")) if n else 0
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        source = halves[n + start : n + stop].copy()
        if dtype == "BF16":
            flat[start:stop] = bfloat16_to_float32(source)
        else:
            flat[start:stop] = source.view(np.float16).astype(np.float32)
    return out, got


def as_stored(array: np.ndarray, dtype: str) -> tuple[str, np.ndarray]:
    """``(safetensors dtype, bytes as an array)`` of ``array`` (float32, float16, float64, or
    MindSpore's bfloat16 from ``asnumpy``) written as float dtype ``dtype`` (BF16: uint16 bits):
    exact where ``dtype`` holds the value, rounded to nearest even otherwise. A non-float array
    keeps its own dtype."""
    is_bf16 = array.dtype.name == "bfloat16"
    if array.dtype.kind != "f" and not is_bf16:
        return _name_of(array), array
    if dtype == "BF16":
        bits = array.view(np.uint16) if is_bf16 else float32_to_bfloat16(array.astype(np.float32, copy=False))
        return dtype, bits
    wide = bfloat16_to_float32(array.view(np.uint16)) if is_bf16 else array
    return dtype, wide.astype(STORED_DTYPES[dtype], copy=False)


def _name_of(array: np.ndarray) -> str:
    """safetensors' name of a non-float ``array``'s dtype."""
    for name, kind in STORED_DTYPES.items():
        if name != "BF16" and array.dtype == np.dtype(kind):
            return name
    raise ValueError(f"no safetensors dtype holds numpy {array.dtype}")


def write_safetensors(path: str | Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict) -> None:
    """Write ``{name: (safetensors dtype, its bytes as an array)}`` as one safetensors file,
    in the given order, with ``metadata`` (``__metadata__``; strings only)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, array) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for _, array in tensors.values():
            handle.write(memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B"))
