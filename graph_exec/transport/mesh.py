"""The device mesh: which ranks form a pipeline and which replicas average gradients together.

The world of ``D·P`` ranks is cut into ``D`` pipeline replicas of ``P`` neighbouring ranks
(replica ``k`` is ``[k·P, …, k·P+P−1]``), so the stages of one pipeline sit next to each other
(on one host when a host runs ``P`` or more ranks) and only the data-parallel all-reduce
crosses between replicas. The data-parallel group of pipeline rank ``r`` is
``{r, r+P, r+2P, …}``.

MindSpore's CPU backend hangs when every rank creates every group (``new_group`` on all ranks,
as one would with torch), but works when each rank creates only the groups it belongs to with
``mindspore.communication.create_group``; that is what the mesh does. Before creating any
group, every rank checks that all ranks asked for the same layout (one small all-reduce over
the world), so a rank with other ``dp``/``pp`` values fails with a clear error instead of
waiting on a group its peers never made.
"""

from __future__ import annotations

import numpy as np

from graph_exec import checks
from graph_exec.errors import CommunicationNotInitializedError, ConfigurationMismatchError
from graph_exec.transport.comm import LAUNCH_HINT, is_initialized, world_all_reduce_sum, world_group_name
from graph_exec.transport.group import CommGroup

#: Seconds the layout check may wait for the other ranks (they all build their mesh at start).
LAYOUT_CHECK_TIMEOUT_S = 300.0

#: Groups this process already created: name -> global ranks (a group is created once).
_created: dict[str, tuple[int, ...]] = {}


def _positive(name: str, value: object) -> int:
    """A positive count; numpy integers (from array arithmetic) are accepted as ints."""
    return checks.positive_int(name, int(value) if isinstance(value, np.integer) else value)


def mesh_layout(world: int, dp: int | None, pp: int | None) -> tuple[int, int]:
    """``(dp, pp)`` for a world of ``world`` ranks; a missing one is derived from the other.

    Raises ``ValueError`` naming the values when ``dp·pp`` is not the world size.
    """
    if dp is not None:
        dp = _positive("dp", dp)
    if pp is not None:
        pp = _positive("pp", pp)
    if dp is None and pp is None:
        return 1, world
    if dp is None:
        dp = world // pp if world % pp == 0 else 0
    if pp is None:
        pp = world // dp if world % dp == 0 else 0
    if dp * pp != world or dp == 0:
        raise ValueError(
            f"DeviceMesh(dp={dp or '?'}, pp={pp or '?'}) needs dp x pp = world size, but the world has "
            f"{world} ranks: choose dp and pp whose product is {world}"
        )
    return dp, pp


def replica_ranks(global_rank: int, pp: int) -> tuple[int, ...]:
    """The global ranks of the pipeline replica that holds ``global_rank``."""
    first = global_rank - global_rank % pp
    return tuple(range(first, first + pp))


def data_parallel_ranks(global_rank: int, dp: int, pp: int) -> tuple[int, ...]:
    """The global ranks holding the same pipeline rank as ``global_rank`` in every replica."""
    return tuple(global_rank % pp + k * pp for k in range(dp))


class DeviceMesh:
    """``dp`` pipeline replicas of ``pp`` ranks each, over the initialised world.

    Build it after ``mindspore.communication.init()`` on every rank, with the same arguments.
    Without communication, ``DeviceMesh()`` is the one-process mesh (``dp = pp = 1``); asking
    for a layout then is an error, since it needs other ranks.

    Args:
        dp: the number of pipeline replicas that average gradients; ``None``: world size / ``pp``.
        pp: the number of ranks per pipeline; ``None``: world size / ``dp`` (both ``None``: one
            pipeline over the whole world, no data parallelism).
    """

    def __init__(self, dp: int | None = None, pp: int | None = None) -> None:
        if not is_initialized():
            if dp is None and pp is None:
                self._set(1, 1, 0, world=True)
                return
            raise CommunicationNotInitializedError(
                f"DeviceMesh(dp={dp}, pp={pp}) was built before mindspore.communication.init(): "
                f"initialise communication first ({LAUNCH_HINT})"
            )
        from mindspore.communication import get_group_size, get_rank

        world, rank = int(get_group_size()), int(get_rank())
        dp, pp = mesh_layout(world, dp, pp)
        if world > 1:
            _check_same_layout(dp, pp, rank)
        self._set(dp, pp, rank, world=False)

    def _set(self, dp: int, pp: int, rank: int, *, world: bool) -> None:
        self.dp_size, self.pp_size, self.global_rank = dp, pp, rank
        world_name = world_group_name() if not world else "world"
        pp_ranks, dp_ranks = replica_ranks(rank, pp), data_parallel_ranks(rank, dp, pp)
        # A group spanning the whole world is the world group; smaller ones get their own name.
        self.pp = CommGroup(world_name if dp == 1 else f"ge_pp{dp}x{pp}_r{rank // pp}", pp_ranks)
        self.dp = CommGroup(world_name if pp == 1 else f"ge_dp{dp}x{pp}_p{rank % pp}", dp_ranks)
        if not world:
            for group in (self.pp, self.dp):
                if group.name != world_name and group.size > 1:
                    _create_group(group)

    # -- the names ---------------------------------------------------------------------

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline (stage ``s`` lives on pipeline rank ``s mod pp``)."""
        return self.pp.rank_of(self.global_rank)

    @property
    def dp_rank(self) -> int:
        """Which pipeline replica this rank belongs to."""
        return self.dp.rank_of(self.global_rank)

    @property
    def pp_group(self) -> str:
        """MindSpore name of this rank's pipeline group."""
        return self.pp.name

    @property
    def dp_group(self) -> str:
        """MindSpore name of this rank's data-parallel group."""
        return self.dp.name

    def describe(self) -> str:
        return f"dp={self.dp_size} x pp={self.pp_size}"

    def __repr__(self) -> str:
        return (
            f"DeviceMesh(dp={self.dp_size}, pp={self.pp_size}; rank {self.global_rank} = "
            f"pipeline rank {self.pp_rank} of replica {self.dp_rank})"
        )


def _create_group(group: CommGroup) -> None:
    """Create ``group`` once per process (this rank belongs to it)."""
    from mindspore.communication import create_group

    known = _created.get(group.name)
    if known is not None:
        if known != group.ranks:  # cannot happen with mesh-made names; guards a future caller
            raise ValueError(f"group {group.name!r} exists with ranks {list(known)}, not {list(group.ranks)}")
        return
    create_group(group.name, list(group.ranks))
    _created[group.name] = group.ranks


def _check_same_layout(dp: int, pp: int, rank: int) -> None:
    """Raise :class:`ConfigurationMismatchError` on every rank unless every rank asked for
    ``(dp, pp)`` (one SUM all-reduce over the world, with a deadline)."""
    world = dp * pp
    mine = np.array([dp, pp, dp * dp, pp * pp], dtype=np.float32)  # float64 all-reduce fails on CPU
    total = world_all_reduce_sum(mine, LAYOUT_CHECK_TIMEOUT_S, "checking the device mesh layout")
    # Equal sums of values and of squares over `world` ranks hold only if every rank agrees.
    if not np.allclose(total, world * mine):
        mean_dp, mean_pp = total[0] / world, total[1] / world
        raise ConfigurationMismatchError(
            f"the ranks asked for different device meshes: rank {rank} has dp={dp}, pp={pp}, but the "
            f"ranks' mean is dp={mean_dp:g}, pp={mean_pp:g}. Build DeviceMesh with the same dp and pp "
            "on every rank"
        )
