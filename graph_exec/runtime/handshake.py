"""Check that every rank of the pipeline was set up the same way, before the first step.

Ranks that disagree — another micro-batch count, a preprocess replica with other parameter
shapes, a frozen tower loaded from another checkpoint — would otherwise fail much later with
a shape error inside a broadcast, or silently train on wrong numbers. Each rank hashes what
must agree; rank 0's hashes are broadcast, every rank compares, and a SUM all-reduce of
per-rank mismatch flags lets *every* rank raise the same error naming the ranks that differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from graph_exec.errors import ConfigurationMismatchError


def describe_parameters(params: list[Any]) -> str:
    """Names, shapes and dtypes of ``params``, in order (what replicas must share)."""
    return ";".join(f"{p.name}:{tuple(p.shape)}:{p.dtype}" for p in params)


def parameter_values_digest(params: list[Any]) -> str:
    """A CRC of the parameters' bytes (frozen replicas are never broadcast, so they must match)."""
    crc = 0
    for p in params:
        crc = zlib.crc32(np.ascontiguousarray(p.asnumpy()).tobytes(), crc)
    return f"{crc:08x}"


def _ranks_flagged(transport: Any, flagged: bool) -> list[int]:
    """The ranks that raised ``flagged`` (one SUM all-reduce of per-rank flags)."""
    import mindspore as ms

    flags = np.zeros(transport.size, dtype=np.float32)
    flags[transport.rank] = float(flagged)
    transport.all_reduce_sum([ms.from_numpy(flags)])
    return [rank for rank, flag in enumerate(flags) if flag > 0]


def share_setup_outcome(transport: Any, local_error: BaseException | None) -> None:
    """Make a set-up failure on any rank stop every rank, before any training message.

    The failing rank re-raises its own error; the others raise one that names it. Without
    this, healthy ranks would wait in the first exchange until their time-out.
    """
    failed = _ranks_flagged(transport, local_error is not None)
    if local_error is not None:
        raise local_error
    if failed:
        raise ConfigurationMismatchError(
            f"pipeline ranks {failed} could not set up (their logs give the reason); rank {transport.rank} stops too"
        )


def check_ranks_agree(transport: Any, facts: Mapping[str, str]) -> None:
    """Raise :class:`ConfigurationMismatchError` on every rank if any rank's ``facts`` differ from rank 0's.

    Every rank must pass the same keys in the same order (only the values may differ).
    """
    import mindspore as ms

    own = np.array([zlib.crc32(f"{k}={v}".encode()) for k, v in facts.items()], dtype=np.int64)
    reference = own.copy()
    transport.broadcast([ms.from_numpy(reference)], src=0)
    differing = [name for name, a, b in zip(facts, own, reference, strict=True) if a != b]
    bad = _ranks_flagged(transport, bool(differing))
    if bad:
        detail = (
            f"; this rank (rank {transport.rank}) differs in: "
            + ", ".join(f"{name} = {facts[name]}" for name in differing)
            if differing
            else ""
        )
        raise ConfigurationMismatchError(
            f"pipeline ranks {bad} were set up differently from rank 0{detail}. Every rank must build "
            "the same stages, micro-batch count and preprocess replica (same parameter shapes; frozen "
            "weights identical, since they are never broadcast)"
        )
