"""Check that every rank of the pipeline was set up the same way, before the first step.

Ranks that disagree — another micro-batch count, a preprocess replica with other parameter
shapes, a frozen tower loaded from another checkpoint — would otherwise fail much later with
a shape error inside a broadcast, or silently train on wrong numbers. Each rank hashes what
must agree; rank 0's hashes are broadcast, every rank compares, and a SUM all-reduce of
per-rank mismatch flags lets *every* rank raise the same error naming the ranks that differ.
With data parallelism the same happens inside each data-parallel group too (pipeline replicas
must agree on their options and their stages' parameters), and the flags travel through both
groups, so a mismatch anywhere stops every rank of the mesh.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
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


def _ranks_flagged(groups: Sequence[Any], flagged: bool) -> list[int]:
    """The global ranks, over the whole mesh, that raised ``flagged``.

    One SUM all-reduce of per-rank flags in each group, in order: after the pipeline group
    every rank knows its replica's flags, after the data-parallel group every rank knows them
    all (each replica's entries come from exactly one member of the group, so nothing is
    counted twice). The groups of one mesh span ``prod(sizes)`` ranks.
    """
    import mindspore as ms

    world = int(np.prod([group.size for group in groups]))
    flags = np.zeros(world, dtype=np.float32)
    flags[groups[0].ranks[groups[0].rank]] = float(flagged)
    tensor = ms.Tensor(flags)
    for group in groups:
        group.all_reduce_sum([tensor])
    # Read through the tensor: on a device the result is not in the array it was made from.
    return [rank for rank, flag in enumerate(tensor.asnumpy()) if flag > 0]


def share_setup_outcome(groups: Sequence[Any], local_error: BaseException | None) -> None:
    """Make a set-up failure on any rank stop every rank of the mesh, before any training message.

    ``groups``: the transports of this rank's pipeline group and (with data parallelism) its
    data-parallel group. The failing rank re-raises its own error; the others raise one that
    names it. Without this, healthy ranks would wait in the first exchange until their time-out.
    """
    failed = _ranks_flagged(groups, local_error is not None)
    if local_error is not None:
        raise local_error
    if failed:
        me = groups[0].ranks[groups[0].rank]
        raise ConfigurationMismatchError(
            f"ranks {failed} could not set up (their logs give the reason); rank {me} stops too"
        )


def _differing(group: Any, facts: Mapping[str, str]) -> list[str]:
    """The names of ``facts`` that differ from the group's rank 0 (one broadcast)."""
    import mindspore as ms

    own = np.array([zlib.crc32(f"{k}={v}".encode()) for k, v in facts.items()], dtype=np.int64)
    reference = ms.Tensor(own)
    group.broadcast([reference], src=0)
    return [name for name, a, b in zip(facts, own, reference.asnumpy(), strict=True) if a != b]


def check_ranks_agree(checks: Sequence[tuple[Any, Mapping[str, str]]]) -> None:
    """Raise :class:`ConfigurationMismatchError` on every rank of the mesh if any rank's facts
    differ from its group's rank 0.

    ``checks``: ``(group transport, facts)`` pairs, the pipeline group first: within a pipeline
    the ranks share the plan and the preprocess replica; across replicas, the same pipeline
    rank also shares its stages' parameters and the data-parallel options. Every rank of a
    group must pass the same keys in the same order (only the values may differ).
    """
    differing = {name: facts[name] for group, facts in checks for name in _differing(group, facts)}
    bad = _ranks_flagged([group for group, _ in checks], bool(differing))
    if bad:
        me = checks[0][0].ranks[checks[0][0].rank]
        detail = (
            f"; this rank (rank {me}) differs in: " + ", ".join(f"{k} = {v}" for k, v in differing.items())
            if differing
            else ""
        )
        raise ConfigurationMismatchError(
            f"ranks {bad} were set up differently from their pipeline's rank 0 or their replica group's "
            f"rank 0{detail}. Every rank must build the same stages, micro-batch count, options and "
            "preprocess replica (same parameter shapes; frozen weights identical, since they are never "
            "broadcast), and every pipeline replica the same model"
        )
