"""Turning a list of samples into one batch; a failure names the sample that caused it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from graph_exec.data.errors import SampleError

#: ``collate(samples) -> batch``: what the loader calls with each batch's samples.
Collate = Callable[[list[Any]], Any]


def stack_samples(samples: list[Any]) -> Any:
    """The default collation: every field stacked on a new dim 0 with ``numpy.stack``.

    A sample is a mapping of fields (a batch dict), a tuple/list of fields (a batch tuple) or
    one array/number. Every sample must have the same fields, each of the same shape; pad
    varying lengths in a collate function of your own (e.g. ``graph_exec.models``' batch
    builder for VLM samples).
    """
    first = samples[0]
    if isinstance(first, Mapping):
        return {key: np.stack([np.asarray(s[key]) for s in samples]) for key in first}
    if isinstance(first, tuple | list):
        return tuple(np.stack([np.asarray(s[i]) for s in samples]) for i in range(len(first)))
    return np.stack([np.asarray(s) for s in samples])


def _fields(sample: Any) -> dict[str, Any]:
    if isinstance(sample, Mapping):
        return {repr(k): v for k, v in sample.items()}
    if isinstance(sample, tuple | list):
        return {f"field {i}": v for i, v in enumerate(sample)}
    return {"the sample": sample}


def _mismatch(samples: Sequence[Any], indices: Sequence[int]) -> tuple[int, str] | None:
    """The first sample whose fields or shapes differ from the first sample's, and how."""
    reference = {k: np.shape(v) for k, v in _fields(samples[0]).items()}
    for index, sample in zip(indices[1:], samples[1:], strict=True):
        fields = _fields(sample)
        if set(fields) != set(reference):
            return index, f"has fields {sorted(fields)}, sample {indices[0]} has {sorted(reference)}"
        for key, value in fields.items():
            if np.shape(value) != reference[key]:
                return index, f"{key} has shape {np.shape(value)}, sample {indices[0]}'s has {reference[key]}"
    return None


def collate_batch(collate: Collate, samples: list[Any], indices: Sequence[int]) -> Any:
    """``collate(samples)``, or a :class:`SampleError` naming the sample (source index) to blame.

    For the default collation that is the first sample whose fields or shapes differ from the
    first one's; for a collate function of your own, the first sample it refuses alone, else
    (each alone is fine) the batch's indices.
    """
    try:
        return collate(samples)
    except Exception as exc:  # the user's function may raise anything: it is re-raised with the index
        cause = exc
    if collate is stack_samples:
        found = _mismatch(samples, indices)
        if found is not None:
            index, how = found
            raise SampleError(index, f"sample {index} cannot be stacked with the batch: {how}") from cause
    else:
        for index, sample in zip(indices, samples, strict=True):
            try:
                collate([sample])
            except Exception as alone:  # as above
                raise SampleError(
                    index, f"sample {index} cannot be collated: {type(alone).__name__}: {alone}"
                ) from alone
    raise SampleError(
        int(indices[0]),
        f"the batch of samples {list(map(int, indices))} cannot be collated: {type(cause).__name__}: {cause}",
    ) from cause


def conversation_collate(
    model: Any = None,
    *,
    micro: int | None = None,
    pad_to: int | Sequence[int] | None = None,
    patch_pad_to: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> Collate:
    """The loader's ``collate`` for samples of :class:`~graph_exec.data.ConversationDataset`.

    With ``model`` (a Qwen2-VL :class:`~graph_exec.models.SplitModel` or whole mindone model):
    :func:`graph_exec.models.vlm_batch` of the samples (``sched.run(*b.inputs,
    labels=b.labels)``), or with ``micro`` :func:`graph_exec.models.vlm_micro_batches`
    (``sched.run(micro_batches=b)``: each micro-batch padded to its own sizes). Without: a
    text-only batch ``((input_ids, position_ids), labels)`` for a Llama/Qwen2 split, padded with
    ``pad_token_id`` (labels ``-100``) to the longest sample or a bucket of ``pad_to``. Pass the
    data set's ``processor.pad_token_id``.
    """
    if model is None:
        if micro is not None or patch_pad_to is not None:
            raise ValueError("micro and patch_pad_to are for a Qwen2-VL model: pass model=")
        return lambda samples: pad_text_samples(samples, pad_to, pad_token_id)
    from graph_exec.models import vlm_batch, vlm_micro_batches

    options = {"pad_to": pad_to, "patch_pad_to": patch_pad_to, "pad_token_id": pad_token_id}
    if micro is None:
        return lambda samples: vlm_batch(model, samples, **options)
    return lambda samples: vlm_micro_batches(model, samples, micro, **options)


def packing_collate(
    model: Any = None,
    *,
    micro: int,
    max_length: int,
    balance: str = "tower",
    seed: int = 0,
    rows: int | None = None,
    row_buckets: Sequence[int] | None = None,
    ragged: bool = False,
    patch_pad_to: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> Collate:
    """The loader's ``collate`` for packed rows: the batch's samples (with ``DataLoader(mesh=...)``,
    this replica's shard) packed by :func:`graph_exec.data.pack` into ``micro`` micro-batches of
    rows of ``max_length`` tokens, for ``sched.run(micro_batches=b)`` with
    ``loss_fn=causal_lm_token_loss, loss_reduction="token"``. With ``model`` (Qwen2-VL):
    :func:`graph_exec.models.vlm_packed_micro_batches`; without: text rows for a Llama/Qwen2
    split made with ``packed=True`` (:func:`graph_exec.models.text_packed_micro_batches`). The
    packing depends only on the samples' sizes and ``seed``: every rank holding the same
    samples packs them the same way. ``rows``, ``row_buckets`` and ``ragged`` are :func:`pack`'s:
    ``ragged=True, row_buckets=row_buckets_upto(B)`` pads least (each micro-batch its own rows;
    replicas need not agree) in few row shapes. A bad option is refused here, not at the first batch."""
    from graph_exec.data.packing import checked_options, pack

    checked_options(micro, balance, rows, row_buckets, ragged)

    def collate(samples: Sequence[Mapping[str, Any]]) -> list:
        import graph_exec.models as gm

        costs = gm.text_sample_costs(samples) if model is None else gm.vlm_sample_costs(model, samples)
        packing = pack(
            costs,
            max_length,
            micro,
            balance=balance,
            seed=seed,
            rows=rows,
            row_buckets=row_buckets,
            ragged=ragged,
        )
        if model is None:
            return gm.text_packed_micro_batches(samples, packing, max_length, pad_token_id=pad_token_id)
        return gm.vlm_packed_micro_batches(
            model, samples, packing, max_length, patch_pad_to=patch_pad_to, pad_token_id=pad_token_id
        )

    return collate


def pad_text_samples(
    samples: Sequence[Mapping[str, Any]], pad_to: int | Sequence[int] | None = None, pad_token_id: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """``((input_ids, position_ids), labels)`` of text-only samples (``{"input_ids",
    "labels"}``), padded on the right: ``pad_token_id`` in the ids, ``-100`` in the labels (a
    causal model's real positions never see the padding after them)."""
    from graph_exec.models.vlm_batch import _bucket

    for k, sample in enumerate(samples):
        if sample.get("images"):
            raise ValueError(
                f"sample {k} has images: a text-only batch takes none (pass model= for Qwen2-VL)"
            )
    lengths = [len(s["input_ids"]) for s in samples]
    longest = int(np.argmax(lengths))
    length = _bucket(
        lengths[longest], pad_to, f"sample {longest} has {lengths[longest]} tokens, which", "pad_to"
    )
    ids = np.full((len(samples), length), pad_token_id, np.int32)
    labels = np.full((len(samples), length), -100, np.int32)
    for b, sample in enumerate(samples):
        ids[b, : lengths[b]] = sample["input_ids"]
        labels[b, : lengths[b]] = sample["labels"]
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy()
    return (ids, positions), labels
