"""The public training API: ``ScheduleMPipeTranspose`` and ``ScheduleInterleaved1F1B``.

Names mirror HyperParallel's pipeline API so its users can switch. A schedule is built on
every rank from that rank's stages; everything that can be checked locally is checked in the
constructor and in ``run()`` before any message is sent, so bad input fails the same way on
every rank instead of hanging the others. The first ``run()`` then sets up the transport,
builds and validates the plan, and checks that all ranks were set up alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graph_exec.bufpool import BufferPool
from graph_exec.errors import CommunicationNotInitializedError, GraphExecError
from graph_exec.executors import MODES, Executor, create_executor
from graph_exec.runtime.buffers import ReceiveBuffers
from graph_exec.runtime.driver import RankRuntime, TimelineEvent
from graph_exec.runtime.handshake import (
    check_ranks_agree,
    describe_parameters,
    parameter_values_digest,
    share_setup_outcome,
)
from graph_exec.runtime.microbatch import split_batch
from graph_exec.runtime.stage import PipelineStage
from graph_exec.schedule import Plan, PlanConfig, buffer_lifetimes, build_plan
from graph_exec.schedule.config import BACKWARD, INPUT, OVERFLOW


def _choice(name: str, value: object, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return str(value)


def _check_stages(stages: PipelineStage | Sequence[PipelineStage]) -> tuple[PipelineStage, ...]:
    local = (stages,) if isinstance(stages, PipelineStage) else tuple(stages)
    if not local or not all(isinstance(s, PipelineStage) for s in local):
        raise TypeError("stages must be a PipelineStage or a non-empty sequence of PipelineStage")
    totals = {s.num_stages for s in local}
    if len(totals) != 1:
        raise ValueError(f"this rank's stages disagree on num_stages: {sorted(totals)}")
    indices = [s.stage_index for s in local]
    if len(set(indices)) != len(indices):
        raise ValueError(f"stage indices repeat on this rank: {indices}")
    return tuple(sorted(local, key=lambda s: s.stage_index))


@dataclass
class _Setup:
    """Everything the first ``run()`` builds, once."""

    plan: Plan
    rank: int
    executor: Executor
    runtime: RankRuntime
    transport: Any | None
    pool: BufferPool


class ScheduleMPipeTranspose:
    """Interleaved 1F1B with the preprocess transposed onto idle warm-up ranks.

    ``stages``: this rank's :class:`PipelineStage` chunks (stage ``s`` on rank ``s mod P``).
    ``preprocess_module``: the first ``num_transpose_layers`` layers of stage 0, replicated on
    every rank (build it identically everywhere; trainable weights are broadcast from rank 0
    at every step, frozen ones never are). ``num_transpose_layers=0`` with no module is the
    dataload-only variant. Options: ``mode`` (``"graph"`` compiled, ``"pynative"`` eager for
    debugging), ``overflow`` (``"full"``/``"min"``), ``backward`` (``"central"``/``"owner"``),
    ``input`` (``"replicated"``: every rank passes the whole batch; ``"owned"``: a rank's
    batch is only read for the micro-batches it owns, the rest reach rank 0 by transfer),
    ``loss_fn(output, *labels)`` (``None``: the last chunk returns the loss), ``scale_grads``
    (divide gradients by the number of micro-batches), ``timeout_s`` (bound on every wait for
    a peer), ``sync_steps`` (wait for every compute step's results before the next step, so
    :attr:`timeline` shows each step's own duration; ``None``: on for CPU, where it was
    measured 2-3x faster, off elsewhere; see ``RankRuntime``), ``recompute`` (``False``: a
    stage's backward runs the bprop of its taped forward; ``True``: keep only its inputs and
    record the forward again in the backward, for runs short of activation memory).
    """

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        preprocess_module: Any = None,
        num_transpose_layers: int = 0,
        *,
        mode: str = "graph",
        overflow: str = "full",
        backward: str = "central",
        input: str = "replicated",
        loss_fn: Callable[..., Any] | None = None,
        scale_grads: bool = False,
        timeout_s: float = 300.0,
        sync_steps: bool | None = None,
        recompute: bool = False,
    ) -> None:
        self.stages = _check_stages(stages)
        if not isinstance(recompute, bool):
            raise ValueError(f"recompute must be a bool (True or False), got {recompute!r}")
        if isinstance(micro_batch_num, bool) or not isinstance(micro_batch_num, int) or micro_batch_num < 1:
            raise ValueError(f"micro_batch_num must be a positive int, got {micro_batch_num!r}")
        layers = num_transpose_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise ValueError(f"num_transpose_layers must be an int >= 0, got {layers!r}")
        if (preprocess_module is None) != (layers == 0):
            raise ValueError(
                f"num_transpose_layers={layers} with preprocess_module="
                f"{'None' if preprocess_module is None else type(preprocess_module).__name__}: pass a "
                "preprocess module with num_transpose_layers >= 1, or neither (dataload only)"
            )
        if preprocess_module is not None:
            from mindspore import nn

            if not isinstance(preprocess_module, nn.Cell):
                raise TypeError(
                    f"preprocess_module must be a mindspore.nn.Cell, got {type(preprocess_module).__name__}"
                )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.micro_batch_num = micro_batch_num
        self.preprocess_module = preprocess_module
        self.num_transpose_layers = layers
        self.mode = _choice("mode", mode, MODES)
        self.overflow = _choice("overflow", overflow, OVERFLOW)
        self.backward = _choice("backward", backward, BACKWARD)
        self.input = _choice("input", input, INPUT)
        self.loss_fn = loss_fn
        self.scale_grads = bool(scale_grads)
        self.timeout_s = float(timeout_s)
        self.sync_steps = sync_steps
        self.recompute = recompute
        self._setup: _Setup | None = None
        self._failed: str | None = None

    # -- public ----------------------------------------------------------------------------

    def run(self, *inputs: Any, labels: Any = None, **kwargs: Any) -> list[Any] | None:
        """One training step: forward and backward of every micro-batch, gradients accumulated.

        ``inputs`` (and ``labels``, ``kwargs`` for the preprocess) are the *global* batch, the
        same on every rank, cut on dim 0 into ``micro_batch_num`` micro-batches. Returns the
        per-micro-batch losses on the rank holding the last stage, ``None`` elsewhere.
        """
        if self._failed is not None:
            raise GraphExecError(
                f"an earlier step failed ({self._failed}); the ranks' message order is lost — restart the job"
            )
        if self.loss_fn is not None and labels is None:
            raise ValueError(
                "labels are required: this schedule has a loss_fn, called as loss_fn(output, *labels)"
            )
        if kwargs and self.preprocess_module is None:
            raise ValueError(
                f"keyword inputs {sorted(kwargs)} go to the preprocess module, but there is none"
            )
        batch = split_batch(inputs, kwargs, labels, self.micro_batch_num)
        setup = self._setup or self._set_up()
        try:
            losses = setup.runtime.run(batch)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        if self.stages[-1].is_last:
            return [losses[m] for m in range(self.micro_batch_num)]
        return None

    def grads(self) -> dict[str, Any]:
        """``{parameter name: gradient}`` for every parameter this rank trains, in the order of
        :meth:`trainable_params` (the live accumulators: read them before the next ``run()``).

        With central backward the preprocess gradient lives on rank 0 only (other ranks receive
        the updated weights by broadcast); with owner backward every rank holds it.
        """
        accumulators = self._require_setup("grads()").executor.grads()
        return {p.name: accumulators[p.name] for p in self.trainable_params()}

    def trainable_params(self) -> list[Any]:
        """The parameters this rank trains, each once (hand them to an optimizer).

        Available before the first ``run()``: the stages' trainable parameters, plus the
        preprocess ones on rank 0 (central backward) or on every rank (owner backward).
        """
        from graph_exec.transport import pipeline_rank

        cells = [s.submodule for s in self.stages]
        if self.preprocess_module is not None and (self.backward == "owner" or pipeline_rank() == 0):
            cells.append(self.preprocess_module)
        unique = {p.name: p for cell in cells for p in cell.trainable_params()}
        return list(unique.values())

    def zero_grad(self) -> None:
        """Reset every gradient buffer of this rank to zero."""
        if self._setup is not None:
            self._setup.executor.zero_grad()

    @property
    def plan(self) -> Plan:
        """The plan (available after the first ``run()``)."""
        return self._require_setup("plan").plan

    @property
    def timeline(self) -> list[TimelineEvent]:
        """What this rank ran in the last step, with start and end times."""
        return [] if self._setup is None else list(self._setup.runtime.timeline)

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks: compilations, receive-buffer pool and message statistics."""
        setup = self._require_setup("stats()")
        compile_stats = setup.executor.compile_stats
        out: dict[str, Any] = {
            "compilations": compile_stats.compilations,
            "compile_seconds": compile_stats.compile_seconds,
            "pool": setup.pool.stats(),
        }
        if setup.transport is not None:
            out["transport"] = setup.transport.stats
        return out

    # -- setup -----------------------------------------------------------------------------

    def _require_setup(self, what: str) -> _Setup:
        if self._setup is None:
            raise GraphExecError(f"{what} is available after the first run()")
        return self._setup

    def _sync_steps(self) -> bool:
        if self.sync_steps is not None:
            return bool(self.sync_steps)
        import mindspore as ms

        return ms.get_context("device_target") == "CPU"

    def _preprocess_kind(self) -> str:
        if self.preprocess_module is None:
            return "none"
        return "trainable" if self.preprocess_module.trainable_params() else "frozen"

    def _set_up(self) -> _Setup:
        from graph_exec.transport import LAUNCH_HINT, Transport, is_initialized

        num_stages = self.stages[0].num_stages
        local = [s.stage_index for s in self.stages]
        transport: Transport | None = None
        if is_initialized():
            transport = Transport(timeout_s=self.timeout_s)
            pp, rank = transport.size, transport.rank
        elif local == list(range(num_stages)):
            pp, rank = 1, 0  # a one-process pipeline needs no communication
        else:
            raise CommunicationNotInitializedError(
                f"this rank holds stages {local} of {num_stages}, so other ranks hold the rest, but "
                f"MindSpore communication is not initialised: {LAUNCH_HINT}"
            )
        if transport is not None and transport.size == 1:
            transport = None
        error: Exception | None = None
        try:
            plan, executor = self._build_local(pp, rank)
        except (ValueError, TypeError) as exc:  # bad set-up: every rank must hear of it
            error = exc
        if transport is not None:
            share_setup_outcome(transport, error)
            check_ranks_agree(transport, self._facts(plan.config))
        elif error is not None:
            raise error
        pool = BufferPool()
        lifetimes = [(lt.recv_index, lt.last_index) for lt in buffer_lifetimes(plan, rank)]
        preprocess_names = [p.name for p in executor.broadcast_tensors()]
        runtime = RankRuntime(
            plan,
            rank,
            executor,
            transport,
            ReceiveBuffers(pool, lifetimes),
            preprocess_grads=lambda: [executor.grads()[n] for n in preprocess_names],
            sync_steps=self._sync_steps(),
        )
        self._setup = _Setup(plan, rank, executor, runtime, transport, pool)
        return self._setup

    def _build_local(self, pp: int, rank: int) -> tuple[Plan, Executor]:
        """The plan and executor of this rank; raises ``ValueError`` if the stages do not fit."""
        num_stages = self.stages[0].num_stages
        local = [s.stage_index for s in self.stages]
        if num_stages % pp:
            raise ValueError(f"num_stages={num_stages} is not a multiple of the {pp} pipeline ranks")
        vpp = num_stages // pp
        expected = [rank + k * pp for k in range(vpp)]
        if local != expected:
            raise ValueError(
                f"rank {rank} of {pp} with {num_stages} stages must hold stages {expected} "
                f"(stage s lives on rank s mod {pp}), got {local}"
            )
        config = PlanConfig(
            pp=pp,
            vpp=vpp,
            micro=self.micro_batch_num,
            preprocess=self._preprocess_kind(),
            num_preprocess_layers=self.num_transpose_layers,
            overflow=self.overflow,
            backward=self.backward,
            input=self.input,
        )
        executor = create_executor(
            self.mode,
            {s.stage_index: s.submodule for s in self.stages},
            preprocess=self.preprocess_module,
            loss_fn=self.loss_fn,
            last_stage=num_stages - 1,
            loss_scale=1.0 / self.micro_batch_num if self.scale_grads else 1.0,
            # Only a trainable preprocess reads dL/d(stage 0 input); otherwise it is wasted work.
            first_stage_input_grads=config.trainable,
            recompute=self.recompute,
        )
        return build_plan(config), executor

    def _facts(self, config: PlanConfig) -> dict[str, str]:
        """What must be identical on every rank (compared by :func:`check_ranks_agree`)."""
        params = [] if self.preprocess_module is None else list(self.preprocess_module.get_parameters())
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        return {
            "plan": f"{config}",
            "loss_fn": "given" if self.loss_fn is not None else "none",
            "scale_grads": str(self.scale_grads),
            "preprocess trainable parameters": describe_parameters(trainable),
            "preprocess frozen parameters": describe_parameters(frozen),
            "preprocess frozen values": parameter_values_digest(frozen),
        }


class ScheduleInterleaved1F1B(ScheduleMPipeTranspose):
    """The baseline: interleaved 1F1B with no preprocess transposition (same API otherwise)."""

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        *,
        mode: str = "graph",
        loss_fn: Callable[..., Any] | None = None,
        scale_grads: bool = False,
        timeout_s: float = 300.0,
        sync_steps: bool | None = None,
        recompute: bool = False,
    ) -> None:
        super().__init__(
            stages,
            micro_batch_num,
            mode=mode,
            loss_fn=loss_fn,
            scale_grads=scale_grads,
            timeout_s=timeout_s,
            sync_steps=sync_steps,
            recompute=recompute,
        )
