"""ZeRO-1 under the pipeline: each data-parallel replica keeps the optimizer state of 1/D of
this pipeline rank's parameters.

With ``optimizer_sharding=True`` the ``D`` replicas of one pipeline rank split its trained
parameters between them, whole parameters each (:func:`partition_by_bytes`: balanced by bytes,
decided from the names and sizes alone, so every replica computes the same split without a
message). Everything before the update is as without sharding: every replica still holds every
gradient, averaged over the replicas by an all-reduce (MindSpore 2.10 has no reduce-scatter
kernel on CPU, so the gradient memory and traffic are not divided; only the optimizer state
is). The user's optimizer is built over the owned parameters only (``sched.optimizer_params()``),
so it allocates state for them alone; ``sched.step(optimizer)`` hands it their gradients, and
then :meth:`OptimizerSharding.gather` gives every replica the updated values: one broadcast per
owner of its parameters, in flat buckets (:class:`~graph_exec.transport.buckets.PackedTensors`),
so after ``step()`` every parameter is whole on every replica again (export and the next step's
forward need nothing else). Measured against the alternative without a new collective (one SUM
all-reduce of every parameter, ``-0.0`` where a rank is not the owner: exact too), llama small
at dp = 2 on this machine (``python -m graph_exec.benchmarks.zero_cost``): the broadcasts took
77-153 ms a step for 4.6 MiB, the sum 186-193 ms (its per-parameter fill costs more than the
second call saves).

The result is bit-identical to the unsharded run: an optimizer update of one parameter reads
only that parameter, its gradient (equal on every replica), its own state and the step count,
so the owner computes exactly what every replica would have. That also holds for the two
copies of a tied pair: their gradients are summed before the update and their states evolve
alike, whoever owns each copy. It does not hold for an optimizer whose state couples parameters
(a tensor not named after one parameter): :func:`check_shardable` refuses it by name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graph_exec.transport.buckets import PackedTensors

#: Optimizer parameters that are not per-parameter state but hold the same value on every
#: replica without depending on any gradient: the step counter, learning rate(s), the Adam
#: ``beta ** step`` powers and the momentum coefficient (``learning_rate`` also as a prefix:
#: per-group rates).
STEP_ONLY_STATE = ("global_step", "learning_rate", "beta1_power", "beta2_power", "momentum")


def partition_by_bytes(sizes: Sequence[tuple[str, int]], parts: int) -> list[int]:
    """The owner (``0 … parts-1``) of each ``(name, nbytes)``, balanced by bytes.

    Largest first, each to the owner with the fewest bytes so far (ties: the lowest owner);
    equal sizes are taken in name order. Depends only on the names and sizes, never on their
    order in ``sizes``, so every replica gets the same answer. Pure: no MindSpore.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    names = [name for name, _ in sizes]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique to partition them")
    loads = [0] * parts
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], sizes[i][0])):
        owner = min(range(parts), key=lambda k: (loads[k], k))
        owners[index] = owner
        loads[owner] += sizes[index][1]
    return owners


def owned_params(params: Sequence[Any], dp_rank: int, dp_size: int) -> list[Any]:
    """The parameters of ``params`` that replica ``dp_rank`` of ``dp_size`` updates."""
    owners = partition_by_bytes([(p.name, int(p.nbytes)) for p in params], dp_size)
    return [p for p, owner in zip(params, owners, strict=True) if owner == dp_rank]


def check_enough_to_share(params: Sequence[Any], dp_size: int) -> None:
    """Every replica must own a parameter: an optimizer over none cannot be built."""
    if len(params) < dp_size:
        raise ValueError(
            f"optimizer_sharding=True splits this rank's {len(params)} trained parameters between "
            f"{dp_size} replicas by parameter, so some would own none: use optimizer_sharding=False "
            f"or a data-parallel size of at most {len(params)}"
        )


def check_shardable(optimizer: Any, params: Sequence[Any]) -> None:
    """Refuse (``ValueError``, naming it) optimizer state that is neither step-only
    (:data:`STEP_ONLY_STATE`) nor named ``<prefix>.<parameter>`` after one of ``params``:
    such state may couple parameters, and sharding by parameter would change the result."""
    names = {p.name for p in params}
    ids = {id(p) for p in params}
    for state in optimizer.get_parameters():
        if id(state) in ids or state.name in STEP_ONLY_STATE or state.name.startswith("learning_rate"):
            continue
        prefix, _, owner = state.name.partition(".")
        if not (prefix and owner in names):
            raise ValueError(
                f"optimizer_sharding=True cannot shard {type(optimizer).__name__}: its state "
                f"{state.name!r} is not named <prefix>.<parameter> after one of the parameters it "
                f"updates, nor step-only ({', '.join(STEP_ONLY_STATE)}); sharding by parameter could "
                "change its result. Use optimizer_sharding=False with this optimizer"
            )


@dataclass
class ShardingStats:
    """What this rank owns and what giving back the updated values cost."""

    owned_parameters: int
    owned_parameter_bytes: int
    parameters: int  #: parameters this rank trains (owned or not)
    parameter_bytes: int
    gathers: int = 0
    gather_bytes: int = 0  #: bytes broadcast per gather (every owner's parameters)
    gather_seconds: float = 0.0  #: total time spent gathering (all steps)


class OptimizerSharding:
    """One rank's share of its pipeline rank's parameters among the ``D`` replicas.

    ``transport``: the data-parallel group's transport; ``params``: what this rank trains, in
    the same order on every replica (checked by the set-up handshake); ``dp_rank``/``dp_size``:
    this replica and the number of replicas.
    """

    def __init__(
        self, transport: Any, params: Sequence[Any], dp_rank: int, dp_size: int, bucket_bytes: int
    ) -> None:
        self.transport = transport
        self._by_owner = [
            PackedTensors(owned_params(params, k, dp_size), bucket_bytes) for k in range(dp_size)
        ]
        self.owned = self._by_owner[dp_rank].tensors
        self.stats = ShardingStats(
            owned_parameters=len(self.owned),
            owned_parameter_bytes=sum(int(p.nbytes) for p in self.owned),
            parameters=len(params),
            parameter_bytes=sum(int(p.nbytes) for p in params),
        )

    def gather(self) -> None:
        """Give every replica the values each owner just computed (every replica, together)."""
        start = time.perf_counter()
        for owner, packed in enumerate(self._by_owner):
            packed.broadcast(self.transport, src=owner)
        self.stats.gathers += 1
        self.stats.gather_bytes = self.stats.parameter_bytes
        self.stats.gather_seconds += time.perf_counter() - start
