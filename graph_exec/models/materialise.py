"""Build and cut a model on one rank, allocating parameter memory only for what the rank holds.

:func:`load_split` builds the whole mindone model under MindSpore's
``mindspore.nn.utils.no_init_parameters`` (every Parameter keeps its initializer and no data),
cuts it with :func:`graph_exec.models.split_model`, and then gives data only to the parameters
of the cells this rank holds: its chunks (stages ``rank, rank + P, …``), the preprocess (which
the schedules replicate on every rank) and, for a tied embedding and head, the head's copy in
the last stage. Everything else stays an initializer: no host memory.

Where the data comes from:

- **a pretrained directory**: the rank reads only its own tensors from the shards, through the
  index (:class:`~graph_exec.hub.directory.PretrainedDirectory`: headers checked with
  safetensors' ``safe_open``, each tensor read from its byte range into its array).
  Before anything is built, every tensor the model needs is checked against the config on every
  rank (name present, shape equal), so a bad directory fails the same way on all ranks before
  any rank communicates. The head copy of a tied pair is read from the embedding's tensor (the
  only copy a tied checkpoint holds).
- **a config**: each parameter is drawn by its own initializer (the one the model chose)
  from a numpy generator seeded by ``(seed, its checkpoint name)``: the value depends on nothing
  but the seed and the name, so every rank that holds a parameter gets the same value, whatever
  else it holds. The head copy of a tied pair is drawn under the embedding's name (equal to it).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindspore.nn.utils import no_init_parameters

from graph_exec.hub.directory import PretrainedDirectory
from graph_exec.hub.dtypes import LOAD_CHOICES
from graph_exec.models.pretrained import (
    checkpoint_names,
    load_config,
    model_class,
)
from graph_exec.models.split import SplitModel, split_model


def _check_rank(num_stages: Any, rank: Any, pp: Any) -> None:
    for what, value, low in (("num_stages", num_stages, 1), ("pp", pp, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    if rank >= pp:
        raise ValueError(f"rank {rank} is not a pipeline rank of pp={pp}: choose 0 … {pp - 1}")
    if num_stages % pp:
        raise ValueError(f"num_stages={num_stages} is not a multiple of pp={pp} (P x V chunks)")


def load_split(
    source: str | Path | Any,
    num_stages: int,
    *,
    rank: int = 0,
    pp: int = 1,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    preprocess: str | None = None,
    trainable_preprocess: bool | None = None,
    image_grid: tuple[int, int, int] | None = None,
    packed: bool = False,
    attn_implementation: str = "eager",
    dtype: str | None = None,
) -> SplitModel:
    """What :func:`split_model` returns for pipeline rank ``rank`` of ``pp``, with parameter
    data only where this rank holds the cell.

    Args:
        source: a pretrained directory (``config.json`` + safetensors, sharded with an index or
            not) or a transformers config (``LlamaConfig``, ``Qwen2Config``, ``Qwen2VLConfig``):
            then every parameter is initialised from ``seed``, equal on every rank.
        num_stages: ``P × V`` chunks; stage ``s`` lives on rank ``s mod pp``.
        rank, pp: this rank's pipeline rank and the pipeline's size (``pp=1``: everything).
        seed: the seed of the config path (not used with a directory).
        layers, preprocess, trainable_preprocess, image_grid, packed: as for :func:`split_model`.
        attn_implementation: the attention a directory's config is read with (``"eager"``: the
            one that runs on CPU).
        dtype: how a directory's floats become parameters: ``"stored"`` keeps the file's dtype
            (a BF16 checkpoint gives BF16 parameters; the schedules accumulate their gradients
            in float32), ``"float32"`` widens BF16/F16 to their exact float32 values. ``None``:
            ``"stored"`` where the target computes in bfloat16, ``"float32"`` on CPU (MindSpore
            2.10 has no bfloat16 MatMul there; :attr:`graph_exec.device.DevicePolicy.computes_bfloat16`).
            The config path draws float32 whatever ``dtype`` says.

    The returned ``SplitModel`` holds every chunk, but only this rank's (and the preprocess)
    have data: hand ``stages[rank::pp]`` to the schedule. ``split.config``, ``rank``, ``pp`` and
    ``checkpoint_names`` and ``source`` are what :func:`graph_exec.models.export_pretrained` needs.

    Raises (each on every rank, before any communication): ``TypeError`` for a family the
    split does not know; ``FileNotFoundError`` for a directory without ``config.json``, without
    weights or with a missing shard; ``ValueError`` for a missing tensor, a tensor whose shape
    differs from the config, a bad ``rank``/``pp``/``num_stages``, and what ``split_model``
    refuses.
    """
    _check_rank(num_stages, rank, pp)
    dtype = _load_dtype(dtype)
    config, model, directory = _skeleton(source, attn_implementation)
    candidates = checkpoint_names(model)  # a tied pair once, under the embedding's name
    keys = _source_keys(model, candidates, directory)
    split = split_model(
        model,
        num_stages,
        layers=layers,
        preprocess=preprocess,
        trainable_preprocess=trainable_preprocess,
        image_grid=image_grid,
        packed=packed,
    )
    source_of = dict(keys)
    if split.tied_weights is not None:  # the head's copy is read (drawn) as the embedding
        source_of[split.tied_weights[1]] = keys[split.tied_weights[0]]
    for param in _held_parameters(split, rank, pp):
        key = source_of[param.name]
        if directory is not None:
            _give(param, directory.read(key, dtype), directory.tensors[key][2])
        elif param.has_init:
            _give(param, seeded_value(param, seed, key))
    split.config, split.rank, split.pp = config, rank, pp
    split.checkpoint_names = {name: names[0] for name, names in candidates.items()}
    split.source = directory.path if directory is not None else None
    return split


def _skeleton(
    source: str | Path | Any, attn_implementation: str
) -> tuple[Any, Any, PretrainedDirectory | None]:
    """The config, the whole model with no parameter data yet, and the pretrained directory
    (``None`` when ``source`` is a config)."""
    directory = None
    if isinstance(source, str | Path):
        config = load_config(source, attn_implementation)
        cls = model_class(config)
        directory = PretrainedDirectory(source)
    else:
        config, cls = source, model_class(source)
    with no_init_parameters():
        model = cls(config)
    return config, model, directory


def _source_keys(
    model: Any, candidates: dict[str, tuple[str, ...]], directory: PretrainedDirectory | None
) -> dict[str, str]:
    """``{parameter name: the name it is read (or seeded) under}``: from a directory the one of
    its candidate names the files hold (the first present), shapes checked; else the first."""
    if directory is None:
        return {name: names[0] for name, names in candidates.items()}
    shapes = {p.name: tuple(p.shape) for p in model.get_parameters()}
    return directory.resolve({name: (names, shapes[name]) for name, names in candidates.items()})


def _held_parameters(split: SplitModel, rank: int, pp: int) -> list:
    """The parameters pipeline rank ``rank`` of ``pp`` gives data to: its stages', the
    preprocess's (every rank runs it), and on rank 0 those no cell holds (so an export is complete)."""
    held: list[nn.Cell] = [split.stages[s] for s in range(rank, len(split.stages), pp)]
    if split.preprocess is not None:
        held.append(split.preprocess)
    mine = {id(p): p for cell in held for p in cell.get_parameters()}
    if rank == 0:
        mine.update({id(p): p for p in split.unplaced.values()})
    return list(mine.values())


def _load_dtype(dtype: str | None) -> str:
    """``load_split``'s ``dtype``, ``None`` resolved for this process's target."""
    if dtype is None:
        from graph_exec.device import policy

        return "stored" if policy().computes_bfloat16 else "float32"
    if dtype not in LOAD_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(LOAD_CHOICES)} or None, got {dtype!r}")
    return dtype


def seeded_value(param: Parameter, seed: int, key: str) -> np.ndarray:
    """``param``'s own initializer drawn from a generator seeded by ``(seed, key)`` alone."""
    data = np.ndarray(tuple(param.shape), dtype=ms.dtype_to_nptype(param.dtype))
    with _numpy_seed(zlib.crc32(f"{seed}/{key}".encode())):
        param.init(data)
    return data


@contextmanager
def _numpy_seed(value: int):
    """MindSpore's initializers draw from numpy's global generator: seed it, then restore it."""
    state = np.random.get_state()
    np.random.seed(value)
    try:
        yield
    finally:
        np.random.set_state(state)


def _give(param: Parameter, value: np.ndarray, stored: str | None = None) -> None:
    """Set ``param``'s data (its first allocation) to ``value``. ``value`` is a fresh writable
    array no one else holds (read from a shard, or drawn): the Parameter takes it over
    (``Tensor.from_numpy`` shares its memory) instead of copying it, so a rank's peak host
    memory does not hold a second copy of its largest tensor. A float ``value`` in another
    16-bit float (float16, or BF16 bits when ``stored`` says ``"BF16"``) makes
    ``param`` that dtype (``load_split(dtype="stored")``); anything else is cast to
    ``param``'s dtype."""
    if stored == "BF16" and value.dtype == np.uint16:
        param.set_dtype(ms.bfloat16)
        param.set_data(Tensor.from_numpy(_own(value)).view(ms.bfloat16))
        return
    want = ms.dtype_to_nptype(param.dtype)
    if value.dtype == np.float16 and want != np.float16:
        param.set_dtype(ms.float16)
        want = np.float16
    array = value if value.dtype == want else value.astype(want)
    param.set_data(Tensor.from_numpy(_own(array)))


def _own(array: np.ndarray) -> np.ndarray:
    """``array`` if a Tensor may take it over (writable, contiguous), else a copy that is."""
    if array.flags.writeable and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array).copy()
