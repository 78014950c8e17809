"""``DataLoader``: each data-parallel replica's batches, shuffled by seed and epoch, resumable.

The order and the shard are :mod:`graph_exec.data.shard`'s (pure functions of the seed, the
epoch and the position), so every rank of a replica gets the same batch without a message, the
replicas read disjoint shards, and a loader restored from :meth:`DataLoader.state_dict`
continues with exactly the batch that came next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

from graph_exec.data import shard
from graph_exec.data.collate import Collate, collate_batch, stack_samples
from graph_exec.data.errors import DataError, SampleError
from graph_exec.data.source import as_source

#: What :meth:`DataLoader.state_dict` holds besides the position: a restored loader must agree.
_IDENTITY = ("num_samples", "global_batch", "shuffle", "seed")


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise DataError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class DataLoader:
    """Batches of one data-parallel replica, for ``schedule.run(*batch)`` on each of its ranks.

    Args:
        source: a sequence of samples (anything with ``len()`` and ``[i]``) or a
            ``mindspore.dataset.GeneratorDataset`` over a random-accessible source (read by
            MindSpore's engine with the loader's indices as sampler; a sample is then
            ``{column: array}``). Build it without ``num_shards``: the loader shards.
        batch_size: samples per replica per step (the batch ``run()`` cuts into micro-batches).
        mesh: a :class:`~graph_exec.DeviceMesh`: this replica is ``mesh.dp_rank`` of
            ``mesh.dp_size``. Or ``dp_rank`` and ``dp_size`` (default 0 of 1).
        shuffle, seed: each epoch reads a permutation drawn from ``(seed, epoch)`` (the same on
            every rank), or the source's order without shuffling.
        collate: ``collate(samples) -> batch``; default :func:`stack_samples` (every field
            stacked on dim 0). A sample that cannot be read or collated raises
            :class:`~graph_exec.data.SampleError` naming its index: none is ever skipped.
        drop_last: the last ``len(source) mod (batch_size * dp_size)`` indices of each epoch's
            permutation do not fill a global batch and are left out of that epoch (``True``);
            ``False`` refuses a source whose length is not a multiple of it.
        micro_batch_num, read_micros: for ``input="owned"``: this rank reads only the samples
            of the micro-batches ``read_micros`` (e.g. ``PlanConfig(...).owned(pp_rank)``); the
            rows of the others are zeros of the same shape (the schedule takes them from their
            owners). Each owned micro-batch is collated on its own. The rank holding the last
            stage needs every micro-batch's labels: read everything there.
        owned_by, sample_cost: for ``input="owned"`` with the schedule itself: ``owned_by`` is this
            rank's schedule (``input="owned"``); each batch reads only the micro-batches the
            schedule places on this rank (:meth:`~graph_exec.ScheduleMPipeTranspose.owned_input`;
            every one on the rank holding the last stage). With ``tower_order="balanced"`` the
            placement needs every micro-batch's cost first: ``sample_cost(index)`` gives a
            sample's tower cost without reading it (its image patches from the data set's index,
            say); each pipeline rank sums the costs of every ``pp``-th micro-batch and one
            all-reduce of those ``micro_batch_num`` numbers over the pipeline (through
            :class:`graph_exec.transport.HostSum`) gives every rank the same costs, so the same
            placement. Pass :attr:`tower_costs` to ``run()``. The first batch sets the schedule up
            (:meth:`~graph_exec.ScheduleMPipeTranspose.set_up`): read it on every rank.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        mesh: Any = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        collate: Collate | None = None,
        drop_last: bool = True,
        micro_batch_num: int | None = None,
        read_micros: Sequence[int] | None = None,
        owned_by: Any = None,
        sample_cost: Callable[[int], float] | None = None,
    ) -> None:
        self.source = as_source(source)
        self.batch_size = _int("batch_size", batch_size, 1)
        if mesh is not None and (dp_rank is not None or dp_size is not None):
            raise DataError("pass mesh or dp_rank/dp_size, not both")
        if mesh is not None:
            dp_rank, dp_size = mesh.dp_rank, mesh.dp_size
        self.dp_size = _int("dp_size", 1 if dp_size is None else dp_size, 1)
        self.dp_rank = _int("dp_rank", 0 if dp_rank is None else dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise DataError(f"dp_rank must be < dp_size={self.dp_size}, got {self.dp_rank}")
        if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
            raise DataError(f"shuffle and drop_last must be bools, got {shuffle!r} and {drop_last!r}")
        self.shuffle, self.drop_last = shuffle, drop_last
        self.seed = _int("seed", seed, 0)
        if collate is not None and not callable(collate):
            raise DataError(f"collate must be callable or None, got {type(collate).__name__}")
        self.collate = stack_samples if collate is None else collate
        self.num_samples = len(self.source)
        self.global_batch = self.batch_size * self.dp_size
        self.steps_per_epoch = shard.steps_per_epoch(self.num_samples, self.batch_size, self.dp_size)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the source has {self.num_samples} samples, fewer than one global batch "
                f"(batch_size {self.batch_size} x dp_size {self.dp_size} = {self.global_batch})"
            )
        left = self.num_samples % self.global_batch
        if left and not drop_last:
            raise DataError(
                f"the source's {self.num_samples} samples are not a multiple of the global batch "
                f"{self.global_batch}: {left} would be left out of every epoch; pass drop_last=True to accept "
                "that or trim the source"
            )
        if owned_by is not None:
            micro_batch_num = self._check_owner(owned_by, sample_cost, micro_batch_num, read_micros)
        elif sample_cost is not None:
            raise DataError(
                "sample_cost is for owned reading with tower_order='balanced': it needs owned_by=schedule"
            )
        self.owned_by, self.sample_cost = owned_by, sample_cost
        self.micro_batch_num, self.read_micros = self._check_micros(micro_batch_num, read_micros)
        #: ``owned_by``: the costs of the last batch's micro-batches (``None`` without balanced
        #: placement), for ``run(..., tower_costs=loader.tower_costs)``, and the micro-batches read.
        self.tower_costs: list[float] | None = None
        self.last_read: tuple[int, ...] | None = None
        self._sizes: Any = None  # the size exchange over the pipeline (made at the first batch)
        self._epoch = 0
        self._step = 0
        self._stream: Iterator[Any] | None = None  # batches from (self._epoch, self._step) on

    def _check_owner(self, owner: Any, cost: Any, micro: int | None, micros: Sequence[int] | None) -> int:
        """``owned_by``'s micro-batch count, once the owned-reading options are consistent."""
        if getattr(owner, "input", None) != "owned":
            raise DataError(
                f"owned_by needs a schedule with input='owned', got {type(owner).__name__} with input="
                f"{getattr(owner, 'input', None)!r}; with replicated input every rank reads the whole batch"
            )
        if micro is not None or micros is not None:
            raise DataError(
                "owned_by takes the micro-batch count and the micro-batches to read from the schedule: "
                "pass neither micro_batch_num nor read_micros"
            )
        micro = _int("micro_batch_num", owner.micro_batch_num, 1)
        if self.batch_size % micro:
            raise DataError(f"batch_size {self.batch_size} is not divisible by micro_batch_num={micro}")
        balanced = owner.tower_order == "balanced"
        if balanced and not callable(cost):
            raise DataError(
                "a schedule with tower_order='balanced' and owned input needs sample_cost=fn(index) -> the "
                f"sample's tower cost, known without reading it (got {cost!r}): the placement decides which "
                "samples this rank reads"
            )
        if not balanced and cost is not None:
            raise DataError("sample_cost is used by tower_order='balanced' only; this schedule has 'arrival'")
        return micro

    def _check_micros(
        self, micro: int | None, micros: Sequence[int] | None
    ) -> tuple[int | None, tuple[int, ...] | None]:
        if micros is None:
            if micro is not None:
                _int("micro_batch_num", micro, 1)
            return micro, None
        if micro is None:
            raise DataError("read_micros needs micro_batch_num (how the schedule cuts the batch)")
        micro = _int("micro_batch_num", micro, 1)
        if self.batch_size % micro:
            raise DataError(f"batch_size {self.batch_size} is not divisible by micro_batch_num={micro}")
        chosen = tuple(sorted({_int("read_micros entry", m, 0) for m in micros}))
        if not chosen or chosen[-1] >= micro:
            raise DataError(
                f"read_micros must name at least one of the micro-batches 0..{micro - 1}, got {list(micros)}"
            )
        return micro, chosen

    # -- position ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def step(self) -> int:
        """The next batch's index in its epoch."""
        return self._step

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``step``: the next batch) and what a restored loader must share."""
        return {"epoch": self._epoch, "step": self._step, **{k: getattr(self, k) for k in _IDENTITY}}

    def check_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """The position in ``state`` if this loader can continue from it, else a :class:`DataError`
        naming every difference (nothing changes)."""
        if not isinstance(state, Mapping) or not {"epoch", "step", *_IDENTITY} <= set(state):
            raise DataError(f"not a DataLoader state_dict: {state!r}")
        differ = [
            f"{k} {state[k]!r} (now {getattr(self, k)!r})" for k in _IDENTITY if state[k] != getattr(self, k)
        ]
        if differ:
            raise DataError("the saved loader position belongs to another data set-up: " + ", ".join(differ))
        epoch, step = _int("epoch", state["epoch"], 0), _int("step", state["step"], 0)
        if step > self.steps_per_epoch:
            raise DataError(f"step {step} is past the {self.steps_per_epoch} batches of an epoch")
        return epoch, step

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (of :meth:`state_dict`): the next batch is the one that followed it."""
        self._epoch, self._step = self.check_state(state)
        self._stream = None

    # -- batches -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch's batches; afterwards the position is the next epoch's start."""
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step, self._stream = self._epoch + 1, 0, None
        while self._step < self.steps_per_epoch:
            yield self.next_batch()

    def next_batch(self) -> Any:
        """The next batch (from the next epoch once this one is done)."""
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step, self._stream = self._epoch + 1, 0, None
        if self._stream is None:
            self._stream = self._batches(self._epoch, self._step)
        try:
            batch = next(self._stream)
        except BaseException:
            self._stream = None  # the position stays at the batch that failed
            raise
        self._step += 1
        return batch

    def next_indices(self) -> np.ndarray:
        """The source indices of the batch :meth:`next_batch` returns (all its rows), without reading it."""
        if self._step >= self.steps_per_epoch:
            return self.indices(self._epoch + 1, 0)
        return self.indices(self._epoch, self._step)

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """The source indices of this replica's batch ``step`` of ``epoch`` (all its rows)."""
        order = shard.epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        return shard.replica_batch(order, step, self.batch_size, self.dp_rank, self.dp_size)

    def _batches(self, epoch: int, first: int) -> Iterator[Any]:
        """Batches ``first..`` of ``epoch``: one read of the source for all of them."""
        if self.owned_by is not None:
            yield from self._placed_batches(epoch, first)
            return
        order = shard.epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        rows = None
        if self.read_micros is not None:
            rows = shard.micro_batch_rows(self.batch_size, self.micro_batch_num, self.read_micros)
        wanted = []
        for step in range(first, self.steps_per_epoch):
            batch = shard.replica_batch(order, step, self.batch_size, self.dp_rank, self.dp_size)
            wanted.append(batch if rows is None else batch[rows])
        samples = self.source.read([int(i) for part in wanted for i in part])
        for indices in wanted:
            chunk = [next(samples) for _ in indices]
            if rows is None:
                yield collate_batch(self.collate, chunk, indices)
            else:
                yield self._owned_batch(chunk, indices, self.read_micros)

    def _placed_batches(self, epoch: int, first: int) -> Iterator[Any]:
        """``owned_by``: per batch, the costs exchanged (balanced), the placement, then one read of
        exactly the micro-batches the schedule places on this rank."""
        order = shard.epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        for step in range(first, self.steps_per_epoch):
            indices = shard.replica_batch(order, step, self.batch_size, self.dp_rank, self.dp_size)
            costs = self._exchanged_costs(indices) if self.sample_cost is not None else None
            read = self.owned_by.owned_input(costs)
            picked = indices[shard.micro_batch_rows(self.batch_size, self.micro_batch_num, read)]
            samples = list(self.source.read([int(i) for i in picked]))
            batch = self._owned_batch(samples, picked, read)
            self.tower_costs, self.last_read = costs, read
            yield batch

    def _exchanged_costs(self, indices: np.ndarray) -> list[float]:
        """Every micro-batch's summed ``sample_cost``: this rank sizes every ``pp``-th one, one
        all-reduce over the pipeline adds the others' (and how many ranks failed to)."""
        schedule = self.owned_by
        schedule.set_up()
        mesh = schedule.mesh
        if self._sizes is None:
            if (mesh.dp_rank, mesh.dp_size) != (self.dp_rank, self.dp_size):
                raise DataError(
                    f"the loader reads replica {self.dp_rank} of {self.dp_size}, its schedule is replica "
                    f"{mesh.dp_rank} of {mesh.dp_size}: pass mesh=the schedule's mesh"
                )
            from graph_exec.transport import HostSum

            self._sizes = HostSum(mesh.pp, schedule.timeout_s)
        micro, per = self.micro_batch_num, self.batch_size // self.micro_batch_num
        share = np.zeros(micro + 1, np.float32)  # the last entry counts the ranks that failed
        failure: SampleError | None = None
        try:
            for m in range(mesh.pp_rank, micro, mesh.pp_size):
                share[m] = math.fsum(self._cost(int(i)) for i in indices[m * per : (m + 1) * per])
        except SampleError as exc:  # told to every rank first: nobody waits for this one
            failure, share[micro] = exc, 1.0
        total = self._sizes(share)
        if failure is not None:
            raise failure
        if total[micro]:
            raise DataError(
                f"{int(total[micro])} other rank(s) of this pipeline could not size their share of the batch "
                "(their own SampleError names the sample)"
            )
        return [float(c) for c in total[:micro]]

    def _cost(self, index: int) -> float:
        """``sample_cost(index)``, or a :class:`SampleError` naming the sample."""
        try:
            cost = self.sample_cost(index)
        except Exception as exc:  # the user's function may raise anything: re-raised naming the sample
            raise SampleError(index, f"sample_cost({index}) failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(cost, bool) or not isinstance(cost, Real) or not 0 <= cost < math.inf:
            raise SampleError(index, f"sample_cost({index}) = {cost!r}: each must be a finite number >= 0")
        return float(cost)

    def _owned_batch(self, samples: list[Any], indices: np.ndarray, micros: Sequence[int]) -> Any:
        """The batch with only ``micros`` read: each collated alone, zeros in the other rows."""
        per = self.batch_size // self.micro_batch_num
        parts = [
            collate_batch(self.collate, samples[k * per : (k + 1) * per], indices[k * per : (k + 1) * per])
            for k in range(len(micros))
        ]
        return _assemble(parts, micros, per, self.batch_size)


def _assemble(parts: list[Any], micros: Sequence[int], per: int, batch_size: int) -> Any:
    """One batch of ``batch_size`` rows from per-micro-batch batches (``micros[k]`` is ``parts[k]``)."""
    first = parts[0]
    if isinstance(first, Mapping):
        return {key: _assemble([p[key] for p in parts], micros, per, batch_size) for key in first}
    if isinstance(first, tuple | list):
        return tuple(_assemble([p[i] for p in parts], micros, per, batch_size) for i in range(len(first)))
    arrays = [np.asarray(p) for p in parts]
    for micro, array in zip(micros, arrays, strict=True):
        if (
            array.shape[:1] != (per,)
            or array.shape[1:] != arrays[0].shape[1:]
            or array.dtype != arrays[0].dtype
        ):
            raise DataError(
                f"micro-batch {micro} collated to {array.dtype}{list(array.shape)}, micro-batch {micros[0]} to "
                f"{arrays[0].dtype}{list(arrays[0].shape)}: owned reading needs {per} rows of one shape per micro-batch"
            )
    out = np.zeros((batch_size, *arrays[0].shape[1:]), arrays[0].dtype)
    for micro, array in zip(micros, arrays, strict=True):
        out[micro * per : (micro + 1) * per] = array
    return out
