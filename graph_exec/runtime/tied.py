"""Tied parameters across pipeline stages: one weight held as two ``Parameter``s on two ranks.

A language model whose input embedding and output projection share one matrix holds the two
uses on different ranks (the embedding in the preprocess or stage 0, the head on the last
stage). Each rank trains its own copy; they stay one weight if they start equal and every
update gets the same gradient, the sum of both uses' gradients. So:

- at construction, the pairs are checked for what one rank can see (two distinct names, no
  name in two pairs, a local name trainable, both local ones of one shape);
- at set-up (the first ``run()``), every rank shares which tied names it holds, their shapes,
  dtypes and a checksum of their values (one object exchange over the job): a name that no
  rank holds, or held by two, two shapes or dtypes, or values that differ, fail on every rank
  with an error naming the pair, before any training message;
- after every step, the gradients of each pair are summed between the ranks holding them: each
  rank puts in what it *counts* (a stage parameter on its rank; a preprocess parameter on
  pipeline rank 0 only, since with owner backward every rank holds the same one), one SUM
  all-reduce over the pipeline group in flat buckets, and every rank that trains one of the two
  takes the sum. The global norm counts the pair once (:mod:`graph_exec.runtime.grad_norm`);
- in the same all-reduce, a checksum of each copy's values: copies that drifted apart (an
  optimizer that treats them differently) fail the step on every rank, naming the pair
  (:mod:`graph_exec.runtime.tied_check`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graph_exec.errors import ConfigurationMismatchError
from graph_exec.runtime.tied_check import TiedCopiesCheck

Pair = tuple[str, str]


def check_pairs(pairs: Any) -> tuple[Pair, ...]:
    """``tied_parameters`` as a tuple of name pairs; a clear ``TypeError``/``ValueError`` else.

    One pair may be given bare, ``("embed.weight", "head.weight")`` (what
    ``SplitModel.tied_weights`` holds): two names cannot be read as a list of pairs, so a
    sequence of exactly two strings is one pair.
    """
    if pairs is None:
        return ()
    if isinstance(pairs, str) or not isinstance(pairs, Sequence):
        raise TypeError(
            f"tied_parameters must be one (name, name) pair or a list of (name, name) pairs, got "
            f"{type(pairs).__name__}: e.g. tied_parameters=[('embed.weight', 'head.weight')]"
        )
    if len(pairs) == 2 and all(isinstance(name, str) for name in pairs):
        pairs = [pairs]
    checked: list[Pair] = []
    seen: dict[str, Pair] = {}
    for pair in pairs:
        if (
            not isinstance(pair, Sequence)
            or isinstance(pair, str)
            or len(pair) != 2
            or not all(isinstance(name, str) and name for name in pair)
        ):
            raise TypeError(
                f"tied_parameters: each entry must be a pair of two parameter names, got {pair!r}"
            )
        first, second = pair
        if first == second:
            raise ValueError(f"tied_parameters: the pair {tuple(pair)!r} names one parameter twice")
        for name in pair:
            if name in seen:
                raise ValueError(
                    f"tied_parameters: {name!r} is in two pairs, {seen[name]!r} and {tuple(pair)!r}; "
                    "tie each weight to one other"
                )
            seen[name] = (first, second)
        checked.append((first, second))
    return tuple(checked)


def check_local(pairs: Sequence[Pair], local: Mapping[str, Any], everything_local: bool) -> None:
    """What this rank can tell at construction: each tied name it holds (``local``: name ->
    ``Parameter`` of its stages and preprocess) is trainable, both names of a pair held here
    share shape and dtype, and, when this rank holds every stage (``everything_local``: no
    other rank could hold a missing name), every name exists."""
    for pair in pairs:
        for name in pair:
            param = local.get(name)
            if param is None:
                if everything_local:
                    raise ValueError(
                        f"tied_parameters: {name!r} of the pair {pair!r} is not a parameter of this "
                        f"schedule's stages or preprocess (names as on their ranks); some names here: "
                        f"{sorted(local)[:8]}"
                    )
                continue
            if not param.requires_grad:
                raise ValueError(
                    f"tied_parameters: {name!r} of the pair {pair!r} is frozen (requires_grad=False); "
                    "only trained weights are tied"
                )
        if all(name in local for name in pair):
            a, b = (local[name] for name in pair)
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise ValueError(
                    f"tied_parameters: {pair!r} are {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}: "
                    "tied weights must have one shape and dtype"
                )


@dataclass(frozen=True)
class HeldTie:
    """What one rank tells the others about a tied name it counts: shape, dtype, checksum."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    accumulator_dtype: str
    crc: int


def describe_held(counted: Mapping[str, Any], accumulators: Mapping[str, Any]) -> list[HeldTie]:
    """This rank's :class:`HeldTie` of every tied name it counts (name -> ``Parameter``)."""
    out = []
    for name, param in counted.items():
        values = np.ascontiguousarray(param.asnumpy()).tobytes()
        acc = accumulators[name]
        out.append(HeldTie(name, tuple(param.shape), str(param.dtype), str(acc.dtype), zlib.crc32(values)))
    return out


def agree(pairs: Sequence[Pair], held_by_rank: Mapping[int, Sequence[HeldTie]]) -> dict[str, HeldTie]:
    """The one holder of each tied name in one pipeline (``held_by_rank``: pipeline rank -> what
    it counts); raises :class:`ConfigurationMismatchError` unless every name is counted by
    exactly one rank and each pair shares shape, dtype and values. Every rank of a pipeline
    sees the same ``held_by_rank``, so all raise the same error."""
    where: dict[str, list[tuple[int, HeldTie]]] = {}
    for rank, held in sorted(held_by_rank.items()):
        for tie in held:
            where.setdefault(tie.name, []).append((rank, tie))
    chosen: dict[str, HeldTie] = {}
    for pair in pairs:
        for name in pair:
            found = where.get(name, [])
            if not found:
                raise ConfigurationMismatchError(
                    f"tied_parameters: {name!r} of the pair {pair!r} is a trained parameter on no pipeline "
                    "rank (names as on their ranks: the stage chunks' and the preprocess's parameter names)"
                )
            if len(found) > 1:
                raise ConfigurationMismatchError(
                    f"tied_parameters: {name!r} of the pair {pair!r} is a parameter on pipeline ranks "
                    f"{[rank for rank, _ in found]}: tied names must be unique across the pipeline"
                )
            chosen[name] = found[0][1]
        (rank_a, a), (rank_b, b) = where[pair[0]][0], where[pair[1]][0]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ConfigurationMismatchError(
                f"tied_parameters: {pair!r} are {a.shape} {a.dtype} (pipeline rank {rank_a}) and {b.shape} "
                f"{b.dtype} (pipeline rank {rank_b}): tied weights must have one shape and dtype"
            )
        if a.crc != b.crc:
            raise ConfigurationMismatchError(
                f"tied_parameters: {pair[0]!r} (pipeline rank {rank_a}) and {pair[1]!r} (pipeline rank {rank_b}) "
                "hold different values at the first step: build them equal (assign one to the other) "
                "before the first run()"
            )
    return chosen


class TiedGradients:
    """Sums the gradients of every tied pair between the ranks holding them (one rank's side).

    ``ties``: the agreed holder facts of every tied name (:func:`agree`); ``counted``: the names
    this rank puts into the sum; ``trained``: the names whose accumulator this rank holds (and
    overwrites with the sum); ``accumulators``: name -> live accumulator; ``transport``: the
    pipeline group's transport (``None`` for a one-rank pipeline: the sum is local).
    """

    def __init__(
        self,
        pairs: Sequence[Pair],
        ties: Mapping[str, HeldTie],
        counted: Sequence[str],
        trained: Sequence[str],
        accumulators: Callable[[], Mapping[str, Any]],
        transport: Any | None,
        check: TiedCopiesCheck,
    ) -> None:
        import mindspore as ms
        from mindspore import Parameter, ops

        from graph_exec.transport.buckets import PackedTensors

        self.pairs = tuple(pairs)
        self._counted = frozenset(counted)
        self._trained = frozenset(trained)
        self._accumulators = accumulators
        self._transport = transport
        dtype = {str(t): t for t in (ms.float16, ms.bfloat16, ms.float32, ms.float64)}
        self._sums = [
            Parameter(
                ops.zeros(ties[a].shape, dtype[ties[a].accumulator_dtype]),
                name=f"tied.{a}",
                requires_grad=False,
            )
            for a, _ in self.pairs
        ]
        self._check = check
        # The copies' checksums ride along (float32 last, beside the float32 sums): one bucket
        # per dtype, so no collective of their own.
        packed = [*sorted(self._sums, key=lambda t: t.dtype == ms.float32), check.slots]
        self._packed = PackedTensors(packed, bucket_bytes=sum(int(t.nbytes) for t in packed))

    def sum_gradients(self) -> None:
        """Make both accumulators of every pair (where held) the sum of the two uses' gradients."""
        from mindspore import ops

        grads = self._accumulators()
        for total, pair in zip(self._sums, self.pairs, strict=True):
            ops.assign(total, ops.zeros_like(total))
            for name in pair:
                if name in self._counted:
                    ops.assign_add(total, grads[name])
        self._check.stamp()
        if self._transport is not None:
            self._packed.all_reduce_sum(self._transport)
        self._check.verify()
        for total, pair in zip(self._sums, self.pairs, strict=True):
            for name in pair:
                if name in self._trained:
                    ops.assign(grads[name], total)


def set_up_ties(
    pairs: Sequence[Pair],
    trained: Mapping[str, Any],
    stage_names: Collection[str],
    executor: Any,
    transport: Any | None,
    mesh: Any,
    timeout_s: float,
) -> TiedGradients:
    """Agree on the tied pairs across this rank's pipeline (every rank of the job calls this at
    set-up) and make this rank's :class:`TiedGradients`.

    ``trained``: name -> ``Parameter`` of everything this rank trains; ``stage_names``: those of
    its stages (a preprocess parameter is counted on pipeline rank 0 only); ``mesh``: the
    :class:`~graph_exec.transport.mesh.DeviceMesh` (its pipeline group's ranks are compared);
    ``timeout_s``: how long the exchange may wait for the other ranks.
    """
    from graph_exec.transport import all_gather_objects, is_initialized

    names = [name for pair in pairs for name in pair]
    counted = {
        name: trained[name]
        for name in names
        if name in trained and (name in stage_names or mesh.pp_rank == 0)
    }
    held = describe_held(counted, executor.grads())
    if is_initialized():
        everyone = all_gather_objects(held, timeout_s, "agreeing on tied parameters")
        by_rank = {mesh.pp.rank_of(rank): everyone[rank] for rank in mesh.pp.ranks}
    else:
        by_rank = {0: held}
    ties = agree(pairs, by_rank)
    return TiedGradients(
        pairs,
        ties,
        list(counted),
        [n for n in names if n in trained],
        executor.grads,
        transport,
        TiedCopiesCheck(pairs, counted),
    )
