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
