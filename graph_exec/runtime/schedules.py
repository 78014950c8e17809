"""The public training API: ``ScheduleMPipeTranspose`` and ``ScheduleInterleaved1F1B``.

Names mirror HyperParallel's pipeline API so its users can switch. Both schedules share one
base, :class:`PipelineSchedule`, and one set of keyword options, declared and checked once in
:class:`~graph_exec.runtime.options.ScheduleOptions`; they differ only in whether the
preprocess is transposed onto idle warm-up ranks. A schedule is built on every rank from that
rank's stages; everything that can be checked locally is checked in the constructor and in
``run()`` before any message is sent, so bad input fails the same way on every rank instead of
hanging the others. The first ``run()`` then sets up the transport, builds and validates the
plan, and checks that all ranks were set up alike (:mod:`graph_exec.runtime.handshake`, with
the facts of :mod:`graph_exec.runtime.setup_facts`).

On a :class:`~graph_exec.transport.mesh.DeviceMesh` with ``dp > 1`` each pipeline replica runs
the schedule on its own batch inside its pipeline group, and after every step the gradients
are averaged over the data-parallel group (see :mod:`graph_exec.runtime.data_parallel`).

What a training loop needs beyond ``run()`` lives beside it: loss scaling with MindSpore's own
scalers and one overflow verdict for the mesh, per-token loss and tied parameters
(:mod:`graph_exec.runtime.step_end`), the global gradient norm (:meth:`clip_grad_norm`,
:mod:`graph_exec.runtime.grad_norm`), :meth:`step`, and forward-only :meth:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from graph_exec import checks
from graph_exec.errors import CommunicationNotInitializedError, GraphExecError
from graph_exec.executors import Executor, create_executor
from graph_exec.runtime.buffers import ReceiveBuffers, Slots, receive_slots
from graph_exec.runtime.data_parallel import DataParallelGrads
from graph_exec.runtime.driver import RankRuntime, TimelineEvent
from graph_exec.runtime.grad_norm import GlobalGradNorm, check_max_norm, check_norm_type, counted_names
from graph_exec.runtime.handshake import check_ranks_agree, share_setup_outcome
from graph_exec.runtime.loss_scaling import LossScale
from graph_exec.runtime.memory_account import optimizer_state_bytes, parameter_bytes, tensors_bytes
from graph_exec.runtime.microbatch import (
    MicroBatches,
    given_micro_batches,
    in_user_order,
    permuted,
    split_batch,
)
from graph_exec.runtime.options import (
    ScheduleOptions,
    option_names,
    options_doc,
    options_from_keywords,
    schedule_signature,
)
from graph_exec.runtime.param_names import check_unique_parameter_names
from graph_exec.runtime.setup_facts import pipeline_facts, replica_facts
from graph_exec.runtime.stage import PipelineStage
from graph_exec.runtime.step_end import StepEnd, per_token_losses
from graph_exec.runtime.tied import check_local, set_up_ties
from graph_exec.runtime.tower_placement import TowerPlacement, describe_tag, placement_tag
from graph_exec.runtime.wait_bounds import WaitBounds, compile_timeout
from graph_exec.schedule import Plan, PlanConfig, buffer_lifetimes, build_plan, placement


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


def _check_preprocess(module: Any, layers: int) -> Any:
    """``module`` when it agrees with ``layers`` (a Cell iff ``layers >= 1``)."""
    if (module is None) != (layers == 0):
        raise ValueError(
            f"num_transpose_layers={layers} with preprocess_module="
            f"{'None' if module is None else type(module).__name__}: pass a "
            "preprocess module with num_transpose_layers >= 1, or neither (dataload only)"
        )
    if module is not None:
        from mindspore import nn

        if not isinstance(module, nn.Cell):
            raise TypeError(f"preprocess_module must be a mindspore.nn.Cell, got {type(module).__name__}")
    return module


@dataclass
class _Setup:
    """Everything the first ``run()`` builds, once."""

    plan: Plan
    rank: int
    executor: Executor
    runtime: RankRuntime
    transport: Any | None
    slots: Slots
    data_parallel: DataParallelGrads | None
    step_end: StepEnd
    grad_norm: GlobalGradNorm
    waits: WaitBounds
    evaluation: RankRuntime | None = None  #: made by the first evaluate()


class PipelineSchedule:
    """What both schedules share: the constructor and its checks, ``run()``, ``evaluate()``, the
    gradient and training-loop methods, and the set-up at the first ``run()``.

    Build a schedule on every rank with the same arguments (its own stages aside): positional
    ``stages`` (this rank's :class:`PipelineStage` chunks, stage ``s`` on pipeline rank
    ``s mod P``), ``micro_batch_num`` (micro-batches per step; the batch is cut into this many on
    dim 0), ``preprocess_module`` and ``num_transpose_layers``, then keyword options, each a
    field of :class:`~graph_exec.runtime.options.ScheduleOptions` (listed in each schedule's
    ``help()``) and readable back as an attribute (``sched.mode``). Everything that can be
    checked locally is checked here, the rest at the first :meth:`run`.
    """

    #: Whether the preprocess is transposed onto the owners (``False``: the fair baseline).
    _transposes = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # help() shows every option of this schedule, from their one declaration.
        cls.__signature__ = schedule_signature(cls._transposes)
        cls.__doc__ = (
            f"{(cls.__doc__ or '').rstrip()}\n\n    Options (keyword arguments, each a field of "
            f":class:`~graph_exec.runtime.options.ScheduleOptions`):\n{options_doc(cls._transposes)}\n"
        )

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        preprocess_module: Any = None,
        num_transpose_layers: int = 0,
        **options: Any,
    ) -> None:
        self.stages = _check_stages(stages)
        self.micro_batch_num = checks.positive_int("micro_batch_num", micro_batch_num)
        self.num_transpose_layers = checks.non_negative_int("num_transpose_layers", num_transpose_layers)
        # Without transposition a rank other than 0 may pass None with the real layer count: the
        # rule "a module iff layers >= 1" then holds for rank 0 only, checked once the rank is known.
        left_out = not self._transposes and preprocess_module is None
        self.preprocess_module = _check_preprocess(
            preprocess_module, 0 if left_out else self.num_transpose_layers
        )
        check_unique_parameter_names(self.stages, preprocess_module)
        #: The checked keyword options (each also readable as an attribute of the schedule).
        self.options: ScheduleOptions = options_from_keywords(options, type(self).__name__, self._transposes)
        if self.keep_preprocess_tape and self._preprocess_kind() != "trainable":
            raise ValueError(
                f"keep_preprocess_tape=True needs a trainable preprocess_module, but the preprocess here "
                f"is {self._preprocess_kind()}: there is no preprocess backward to take from a tape"
            )
        local = {p.name: p for cell in self._cells() for p in cell.get_parameters()}
        everything_local = [s.stage_index for s in self.stages] == list(range(self.stages[0].num_stages))
        check_local(self.tied_parameters, local, everything_local)
        if self.tower_order == "balanced" and self.num_transpose_layers == 0:
            raise ValueError(
                "tower_order='balanced' places the preprocess of each micro-batch by its cost, but there "
                "is no preprocess (num_transpose_layers=0); use tower_order='arrival'"
            )
        self._check_plan_options()
        self._placement = TowerPlacement(self.micro_batch_num, self.tower_order)
        self._mesh: Any = None  # the mesh the first run() set up on
        self._setup: _Setup | None = None
        self._failed: str | None = None
        self._accumulated = False  # whether the accumulators hold gradients (since zero_grad())
        self._ran = False  # whether a training step ran: the gradient methods need one
        self._grads_finite: bool | None = None
        self._optimizer_state: tuple[int, int] | None = None  # (id of the optimizer, its state bytes)

    @property
    def mesh(self) -> Any:
        """The ``mesh`` option; after the first ``run()`` the mesh set up on (a one-pipeline mesh
        over the whole world when the option is ``None``)."""
        return self._mesh if self._mesh is not None else self.options.mesh

    def _cells(self) -> list[Any]:
        """This rank's stage chunks and its preprocess (if it passed one)."""
        cells = [s.submodule for s in self.stages]
        return cells if self.preprocess_module is None else [*cells, self.preprocess_module]

    def _check_tower_costs(self, tower_costs: Any) -> tuple[float, ...] | None:
        """The per-micro-batch tower costs of a call, checked before any message."""
        if tower_costs is None:
            if self.tower_order == "balanced":
                raise ValueError(
                    f"tower_order='balanced' needs tower_costs=[...] in run()/evaluate(): one number per "
                    f"micro-batch ({self.micro_batch_num}), its preprocess cost in units of one chunk forward"
                )
            return None
        return placement.check_tower_costs(tower_costs, self.micro_batch_num, ValueError)

    def _tower_placement(self, config: PlanConfig, costs: tuple[float, ...] | None) -> tuple[int, ...]:
        """``order[m]``: the batch's micro-batch that runs as plan micro ``m``, for training and
        evaluation alike (:mod:`graph_exec.runtime.tower_placement`)."""
        return self._placement.order(config, costs)

    def _step_tag(self, order: tuple[int, ...]) -> tuple[int, Any]:
        """The tag every transfer of a step with ``order`` carries, and how to name one: ranks
        that placed the towers differently fail at their first transfer
        (:mod:`graph_exec.runtime.tower_placement`)."""
        return placement_tag(order), partial(describe_tag, micro=self.micro_batch_num)

    # -- public ----------------------------------------------------------------------------

    def set_up(self) -> None:
        """Set up communication and the plan now, as the first ``run()`` would (every rank,
        together); afterwards :attr:`plan` and :attr:`mesh` are this rank's. Does nothing the
        second time. An owned-input data loader calls it before reading its first batch."""
        if self._setup is None:
            self._set_up()

    def placement(self, tower_costs: Any = None) -> tuple[int, ...]:
        """``order[m]``: the batch's micro-batch that the next ``run(..., tower_costs=...)`` runs
        as plan micro ``m`` (the identity with ``tower_order="arrival"``); the same on every rank
        given the same costs. Sets up like :meth:`set_up`."""
        costs = self._check_tower_costs(tower_costs)
        setup = self._setup or self._set_up()
        return self._tower_placement(setup.plan.config, costs)

    def owned_input(self, tower_costs: Any = None) -> tuple[int, ...]:
        """With ``input="owned"``: the batch's micro-batches (ascending, the user's numbering)
        whose rows this rank must hold for the next ``run()`` with these costs: those placed on
        the plan micro-batches it owns, or every one on the rank holding the last stage (it needs
        every label). The other rows may hold anything of the same shape. Sets up like :meth:`set_up`."""
        if self.input != "owned":
            raise GraphExecError(
                f"owned_input() needs input='owned', this schedule has input={self.input!r}: "
                "every rank passes the whole batch"
            )
        order = self.placement(tower_costs)
        if self.stages[-1].is_last:
            return tuple(range(self.micro_batch_num))
        return tuple(sorted(order[m] for m in self.plan.config.owned(self.mesh.pp_rank)))

    def run(
        self,
        *inputs: Any,
        labels: Any = None,
        tower_costs: Any = None,
        micro_batches: Any = None,
        **kwargs: Any,
    ) -> list[Any] | None:
        """One training step: forward and backward of every micro-batch, gradients accumulated.

        ``inputs`` (and ``labels``, ``kwargs`` for the preprocess) are this pipeline replica's
        batch, the same on every rank of the replica, cut on dim 0 into ``micro_batch_num``
        micro-batches (without data parallelism: the global batch); ``mindspore.Tensor`` or
        numpy arrays, which are converted with their dtype. With ``dp > 1`` the gradients are
        averaged over the replicas after the step; with a loss scaler they are unscaled and
        :attr:`grads_finite` holds the mesh's verdict. Returns the per-micro-batch losses
        (``sum / count`` with ``loss_reduction="token"``) on the rank holding the last stage,
        ``None`` elsewhere. ``tower_costs`` (with ``tower_order="balanced"``): each micro-batch's
        preprocess cost, e.g. its image patches times a calibrated cost per patch, in units of one
        chunk forward; the same on every rank of the replica.

        ``micro_batches=[(inputs, labels), ...]`` (instead of ``inputs`` and ``labels``): the step
        already cut, exactly ``micro_batch_num`` pairs in the user's order (a
        :class:`~graph_exec.models.VLMBatch` is one), each padded to its own sizes only: shapes
        may differ between micro-batches, the number of tensors and their dtypes may not
        (:func:`~graph_exec.runtime.microbatch.given_micro_batches`). A micro-batch of small
        images then runs the tower at its own patch count, which is what ``tower_costs`` should
        count. Not with ``input="owned"`` yet.
        """
        costs = self._check_tower_costs(tower_costs)
        batch = self._check_batch(
            "run()", inputs, labels, kwargs, labels_required=True, micro_batches=micro_batches
        )
        setup = self._setup or self._set_up()
        order = self._tower_placement(setup.plan.config, costs)
        setup.waits.before_step("run", batch)
        try:
            setup.step_end.begin(self._accumulated)
            results = setup.runtime.run(permuted(batch, order), *self._step_tag(order))
            losses, finite = setup.step_end.finish(results)
        except BaseException as exc:
            setup.step_end.abandon()
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        self._accumulated = self._ran = True
        self._grads_finite = finite
        if self.stages[-1].is_last:
            return in_user_order(losses, order)
        return None

    def evaluate(
        self,
        *inputs: Any,
        labels: Any = None,
        tower_costs: Any = None,
        micro_batches: Any = None,
        **kwargs: Any,
    ) -> list[Any] | None:
        """Forward only, through the same plan's forward half (``docs/schedule.md``,
        "Forward-only plans"): MPipe still runs the preprocess of the micro-batches a rank owns
        on that rank and ships it to rank 0. Nothing is taped, no gradient and no optimizer
        state is touched. Call it on every rank, with the batch as for :meth:`run`.

        Returns, on the rank holding the last stage, the per-micro-batch losses when
        ``labels`` are given (``sum / count`` with ``loss_reduction="token"``), else the last
        stage's per-micro-batch outputs (a tensor each, or a tuple for several outputs);
        ``None`` elsewhere. Cells run as they are: call ``set_train(False)`` on them first for
        layers that behave differently in evaluation (dropout). ``tower_costs`` and
        ``micro_batches`` (labels ``None`` in every pair for the outputs): as for :meth:`run`.
        """
        costs = self._check_tower_costs(tower_costs)
        batch = self._check_batch(
            "evaluate()", inputs, labels, kwargs, labels_required=False, micro_batches=micro_batches
        )
        setup = self._setup or self._set_up()
        setup.waits.before_step("evaluate", batch)
        try:
            if setup.evaluation is None:
                plan = build_plan(replace(setup.plan.config, forward_only=True))
                setup.evaluation = self._runtime(
                    plan, setup.rank, setup.executor, setup.transport, setup.slots
                )
            order = self._tower_placement(setup.evaluation.plan.config, costs)
            results = setup.evaluation.run(permuted(batch, order), *self._step_tag(order))
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            raise
        if not self.stages[-1].is_last:
            return None
        if batch.labels is None:
            return [r[0] if len(r) == 1 else r for r in in_user_order(results, order)]
        if self.loss_reduction == "token":
            results = per_token_losses(results)[0]
        return in_user_order(results, order)

    @property
    def grads_finite(self) -> bool:
        """Whether every gradient of the last ``run()`` was finite on every rank of the mesh
        (the same answer everywhere): the verdict the loss scaler was adjusted with. Needs a
        ``loss_scaler`` (``mindspore.amp.StaticLossScaler(1)`` checks without scaling)."""
        self._require_step("grads_finite")
        if self.loss_scaler is None:
            raise GraphExecError(
                "grads_finite needs a loss_scaler: without one the gradients are not checked; "
                "pass loss_scaler=mindspore.amp.StaticLossScaler(1) to check them without scaling"
            )
        return bool(self._grads_finite)

    def clip_grad_norm(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> float:
        """The global ``norm_type``-norm of every trained gradient of the whole model (every
        parameter counted once over the pipeline, the replicated preprocess, the data-parallel
        replicas and tied pairs), the same on every rank; then this rank's gradients are scaled
        in place by ``min(1, max_norm / (norm + 1e-6))``. ``max_norm=float("inf")`` only
        measures; ``norm_type=float("inf")`` is the largest ``|g|``. Call it on every rank, after
        ``run()``: one small collective over the pipeline group (and the failure flags over the
        data-parallel group), or none when the step's end measured the norm in its own (with a
        loss scaler or per-token loss, from the second clipped step on). A rank that fails to
        measure its share makes every rank raise (:mod:`graph_exec.runtime.update_gate`).

        A norm that is not finite is returned, nothing is scaled, and every rank warns
        (:class:`~graph_exec.runtime.grad_norm.NonFiniteGradientWarning`); with
        ``error_if_nonfinite=True`` every rank raises
        :class:`~graph_exec.errors.NonFiniteGradientError` instead.
        """
        max_norm, norm_type = check_max_norm(max_norm), check_norm_type(norm_type)
        error_if_nonfinite = checks.boolean("error_if_nonfinite", error_if_nonfinite)
        setup = self._require_step("clip_grad_norm()")
        try:
            return setup.step_end.gate.clip(max_norm, norm_type, error_if_nonfinite)
        except BaseException as exc:
            self._failed = setup.step_end.gate.after_failure(exc)
            raise

    def step(
        self, optimizer: Any, max_norm: float | None = None, *, error_if_nonfinite: bool = False
    ) -> dict[str, Any]:
        """The usual end of a training step, in one call on every rank: skip it when a gradient
        is not finite anywhere in the mesh, else clip by the global norm (with ``max_norm``) and
        apply ``optimizer`` to this rank's gradients; then zero them.

        ``optimizer``: a MindSpore optimizer built over :meth:`trainable_params` (its
        ``parameters`` give the order of the gradients it is called with; the float32
        gradients of float16/bfloat16 parameters are handed over in the parameter's dtype). Returns
        ``{"finite": bool, "grad_norm": float or None (no clipping, or a skipped step),
        "loss_scale": the scale the next run() uses, or None}``.

        One verdict for the whole mesh (:mod:`graph_exec.runtime.update_gate`): with a loss
        scaler its overflow check; without one the norm when clipping, else one pass over the
        gradients and one small collective. A non-finite step is skipped on every rank and,
        without a loss scaler, warned about once on every rank
        (:class:`~graph_exec.runtime.grad_norm.NonFiniteGradientWarning`);
        ``error_if_nonfinite=True`` raises :class:`~graph_exec.errors.NonFiniteGradientError`
        on every rank instead, the gradients left as they are. A bad optimizer on one rank
        makes every rank raise (the others :class:`~graph_exec.errors.RemoteRankError`), nothing
        applied anywhere, the schedule still usable.
        """
        if max_norm is not None:
            max_norm = check_max_norm(max_norm)
        error_if_nonfinite = checks.boolean("error_if_nonfinite", error_if_nonfinite)
        setup = self._require_step("step()")
        try:  # a bad optimizer may fail on one rank only: the verdict tells every rank
            params, problem = self._optimizer_params(optimizer), None
            self._note_optimizer(optimizer, params)
        except (TypeError, ValueError) as exc:
            params, problem = (), exc
        try:
            verdict = setup.step_end.gate.before_update(
                optimizer, problem, self._grads_finite, max_norm, error_if_nonfinite
            )
            if verdict.finite:
                grads = self.grads()
                # float32 accumulators of float16/bfloat16 parameters: MindSpore's optimizers want
                # the parameter's own dtype (Adam refuses float32 gradients for float16 weights).
                optimizer(
                    tuple(
                        grads[p.name] if grads[p.name].dtype == p.dtype else grads[p.name].astype(p.dtype)
                        for p in params
                    )
                )
        except BaseException as exc:
            self._failed = setup.step_end.gate.after_failure(exc)
            raise
        self.zero_grad()
        return {
            "finite": verdict.finite,
            "grad_norm": verdict.norm,
            "loss_scale": setup.step_end.loss_scale.value(),
        }

    def grads(self) -> dict[str, Any]:
        """``{parameter name: gradient}`` for every parameter this rank trains, in the order of
        :meth:`trainable_params` (the live accumulators: read them before the next ``run()``).

        With central backward the preprocess gradient lives on pipeline rank 0 only (other ranks
        receive the updated weights by broadcast); with owner backward every rank holds it.
        With data parallelism they are the means over the replicas.
        """
        setup = self._require_setup("grads()")
        setup.grad_norm.forget()  # the caller may change them in place
        accumulators = setup.executor.grads()
        return {p.name: accumulators[p.name] for p in self.trainable_params()}

    def trainable_params(self) -> list[Any]:
        """The parameters this rank trains, each once (hand them to an optimizer).

        Available before the first ``run()``: the stages' trainable parameters, plus the
        preprocess ones on pipeline rank 0 (central backward) or on every rank (owner backward).
        """
        from graph_exec.transport import pipeline_rank

        pp_rank = pipeline_rank() if self.mesh is None else self.mesh.pp_rank
        cells = [s.submodule for s in self.stages]
        if self.preprocess_module is not None and (self.backward == "owner" or pp_rank == 0):
            cells.append(self.preprocess_module)
        # By identity, not by name: a name shared by two Parameters is rejected at construction.
        unique = {id(p): p for cell in cells for p in cell.trainable_params()}
        return list(unique.values())

    def zero_grad(self) -> None:
        """Reset every gradient buffer of this rank to zero."""
        if self._setup is not None:
            self._setup.executor.zero_grad()
            self._setup.grad_norm.forget()
        self._accumulated = False

    @property
    def plan(self) -> Plan:
        """The plan (available after the first ``run()``)."""
        return self._require_setup("plan").plan

    @property
    def timeline(self) -> list[TimelineEvent]:
        """What this rank ran in the last step, with start and end times."""
        return [] if self._setup is None else list(self._setup.runtime.timeline)

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks: compilations (the library's first calls per kernel and MindSpore's
        own count, ``None`` where not exposed), the kernel cache, receive-buffer pool and message
        statistics."""
        setup = self._require_setup("stats()")
        compile_stats = setup.executor.compile_stats
        out: dict[str, Any] = {
            "compilations": compile_stats.compilations,
            "compile_seconds": compile_stats.compile_seconds,
            "mindspore_compilations": compile_stats.mindspore_compilations,
            "kernel_cache": {
                "size": self.kernel_cache_size,
                "entries": compile_stats.cached_kernels,
                "evictions": compile_stats.evictions,
            },
            "pool": setup.slots.stats(),
        }
        if setup.transport is not None:
            out["transport"] = setup.transport.stats
        if setup.data_parallel is not None:
            out["data_parallel"] = setup.data_parallel.stats
        out["memory"] = self._memory_stats(setup)
        return out

    def _memory_stats(self, setup: _Setup) -> dict[str, Any]:
        """``stats()["memory"]``: this rank's bytes (``docs/api.md`` lists every key)."""
        from graph_exec.device import memory_peaks

        cells = [s.submodule for s in self.stages]
        if self.preprocess_module is not None and setup.plan.config.preprocess != "none":
            cells.append(self.preprocess_module)  # the baseline's ranks but 0 ignore theirs
        return {
            "parameters": parameter_bytes(cells),
            "gradient_accumulators": tensors_bytes(setup.executor.grads().values()),
            "optimizer_state": None if self._optimizer_state is None else self._optimizer_state[1],
            "zb_buffers": setup.executor.split_buffer_bytes,
            **setup.runtime.memory.peaks(),
            **setup.runtime.memory_prediction(self.recompute),
            **memory_peaks(),
            "caches": self._cache_stats(setup),
        }

    def _cache_stats(self, setup: _Setup) -> dict[str, dict[str, Any]]:
        """``stats()["memory"]["caches"]``: what each per-shape cache of this rank keeps now and
        its bound (``docs/architecture.md``, "Caches and their bounds")."""
        transport = setup.transport
        compile_stats = setup.executor.compile_stats
        return {
            "send_frames": None if transport is None else transport.frames.cache_stats(),
            "receive_slots": setup.slots.cache_stats(),
            "kernels": {
                "entries": compile_stats.cached_kernels,
                "bytes": compile_stats.cached_bytes,
                "max_entries": self.kernel_cache_size,
                "evictions": compile_stats.evictions,
            },
        }

    def _note_optimizer(self, optimizer: Any, params: Sequence[Any]) -> None:
        """Remember the bytes of the state of the optimizer :meth:`step` applies (once per optimizer)."""
        if self._optimizer_state is None or self._optimizer_state[0] != id(optimizer):
            self._optimizer_state = (id(optimizer), optimizer_state_bytes(optimizer, params))

    # -- setup -----------------------------------------------------------------------------

    def _require_setup(self, what: str) -> _Setup:
        if self._setup is None:
            raise GraphExecError(f"{what} is available after the first run()")
        return self._setup

    def _require_step(self, what: str) -> _Setup:
        """The set-up, once a training step ran and none failed (before any communication)."""
        self._refuse_after_failure()
        if not self._ran:
            raise GraphExecError(f"{what} needs the gradients of a step: call run() first")
        return self._setup

    def _refuse_after_failure(self) -> None:
        if self._failed is not None:
            raise GraphExecError(
                f"an earlier step failed ({self._failed}); the ranks' message order is lost — restart the job"
            )

    def _check_batch(
        self,
        what: str,
        inputs: tuple[Any, ...],
        labels: Any,
        kwargs: dict[str, Any],
        labels_required: bool,
        micro_batches: Any = None,
    ) -> MicroBatches:
        """The micro-batches of a ``run()``/``evaluate()`` call, after every local check."""
        self._refuse_after_failure()
        needs_labels = labels_required and self.loss_fn is not None
        if micro_batches is not None:
            self._check_given_micro_batches(what, inputs, labels, kwargs)
            pad = (
                None
                if self.options.bucketing is None
                else partial(self._pad, labels_required=labels_required)
            )
            return given_micro_batches(
                micro_batches, self.micro_batch_num, labels_required=needs_labels, pad=pad
            )
        if needs_labels and labels is None:
            raise ValueError(
                "labels are required: this schedule has a loss_fn, called as loss_fn(output, *labels)"
            )
        if kwargs and self.preprocess_module is None and self.num_transpose_layers == 0:
            raise ValueError(
                f"keyword inputs {sorted(kwargs)} go to the preprocess module, but there is none"
            )
        if self.options.bucketing is not None:
            inputs, labels = self._pad(inputs, labels, labels_required=labels_required)
        return split_batch(inputs, kwargs, labels, self.micro_batch_num)

    def _pad(self, inputs: Any, labels: Any, *, labels_required: bool) -> tuple[Any, Any]:
        """``(inputs, labels)`` padded to the shape buckets, the masks after the labels."""
        padded, with_masks = self.options.bucketing.pad(inputs, labels)
        # The masks go to the loss; a forward-only call without labels has none to take them.
        return padded, (with_masks if labels is not None or labels_required else None)

    def _check_given_micro_batches(
        self, what: str, inputs: tuple[Any, ...], labels: Any, kwargs: dict[str, Any]
    ) -> None:
        """``micro_batches=`` carries the whole step: nothing else may, and owned input (each
        rank holding only its own rows) is not supported with it yet."""
        if inputs or kwargs or labels is not None:
            given = [f"{len(inputs)} positional inputs"] if inputs else []
            given += [f"keyword inputs {sorted(kwargs)}"] if kwargs else []
            given += ["labels="] if labels is not None else []
            raise ValueError(
                f"{what} got micro_batches= and also {', '.join(given)}: pass the step's data one way, "
                "either the whole batch (cut into equal micro-batches) or micro_batches=[(inputs, labels), ...]"
            )
        if self.input == "owned":
            raise ValueError(
                f"{what} with micro_batches= is not supported yet with input='owned': pass the whole "
                "batch, or use input='replicated'"
            )

    def _optimizer_params(self, optimizer: Any) -> tuple[Any, ...]:
        """``optimizer``'s parameters, each one this rank trains (the order of its gradients)."""
        params = getattr(optimizer, "parameters", None)
        if not callable(optimizer) or params is None:
            raise TypeError(
                f"optimizer must be a MindSpore optimizer (mindspore.nn.Adam, ...), got {type(optimizer).__name__}"
            )
        grads = self._require_setup("step()").executor.grads()  # not grads(): nothing handed out
        missing = [p.name for p in params if p.name not in grads]
        if missing:
            raise ValueError(
                f"the optimizer updates {missing[:4]}, which this rank does not train: build it over "
                "sched.trainable_params()"
            )
        return tuple(params)

    def _sync_steps(self) -> bool:
        if self.sync_steps is not None:
            return bool(self.sync_steps)
        from graph_exec.device import policy

        return policy().sync_steps_default

    def _preprocess_kind(self) -> str:
        if self.preprocess_module is None:
            return "none"
        return "trainable" if self.preprocess_module.trainable_params() else "frozen"

    def _set_up(self) -> _Setup:
        from graph_exec.transport import LAUNCH_HINT, Transport, bound_backend_waits, is_initialized
        from graph_exec.transport.mesh import DeviceMesh

        num_stages = self.stages[0].num_stages
        local = [s.stage_index for s in self.stages]
        if self.mesh is None and not is_initialized() and local != list(range(num_stages)):
            raise CommunicationNotInitializedError(
                f"this rank holds stages {local} of {num_stages}, so other ranks hold the rest, but "
                f"MindSpore communication is not initialised: {LAUNCH_HINT}"
            )
        compile_s = compile_timeout(self.compile_timeout_s, self.timeout_s)
        if is_initialized():  # before the first message (the mesh check); a lone process sends none
            bound_backend_waits(compile_s)  # the longest wait; the transports bound each step's
        mesh = self.mesh if self.mesh is not None else DeviceMesh()
        self._mesh = mesh
        pp, rank = mesh.pp_size, mesh.pp_rank
        kept = self.buffer_cache_bytes
        transport = (
            Transport(timeout_s=self.timeout_s, group=mesh.pp, frame_cache_bytes=kept) if pp > 1 else None
        )
        dp_transport = (
            Transport(timeout_s=self.timeout_s, group=mesh.dp, frame_cache_bytes=kept)
            if mesh.dp_size > 1
            else None
        )
        error: Exception | None = None
        try:
            plan, executor = self._build_local(pp, rank)
        except (ValueError, TypeError) as exc:  # bad set-up: every rank must hear of it
            error = exc
        groups = [t for t in (transport, dp_transport) if t is not None]
        if groups:
            share_setup_outcome(groups, error)
            agree = [(transport, pipeline_facts(self, plan.config))] if transport is not None else []
            if dp_transport is not None:
                agree.append((dp_transport, replica_facts(self, plan.config)))
            check_ranks_agree(agree)
        elif error is not None:
            raise error
        data_parallel = None
        if dp_transport is not None:
            params = self.trainable_params()
            data_parallel = DataParallelGrads(
                dp_transport, params, lambda: [executor.grads()[p.name] for p in params], self.dp_bucket_bytes
            )
            data_parallel.start_in_sync()
        trained = [p.name for p in self.trainable_params()]
        stage_names = {p.name for s in self.stages for p in s.submodule.trainable_params()}
        tied = None
        if self.tied_parameters:  # after the replicas took replica 0's values: those are compared
            trains = {p.name: p for p in self.trainable_params()}
            tied = set_up_ties(
                self.tied_parameters, trains, stage_names, executor, transport, mesh, self.timeout_s
            )
        counted = counted_names(trained, stage_names, rank, [b for _, b in self.tied_parameters])
        grad_norm = GlobalGradNorm(executor, counted, transport, rank, pp)
        step_end = StepEnd(
            executor,
            (transport, dp_transport),
            mesh.dp_size,
            LossScale(
                self.loss_scaler,
                self._loss_scale_base(),
                compiled=self.mode == "graph",
                jit_options=self.jit_options,
            ),
            self.loss_reduction == "token",
            data_parallel,
            tied,
            grad_norm,
        )
        slots = receive_slots(self.buffer_cache_bytes)
        runtime = self._runtime(plan, rank, executor, transport, slots)
        waits = WaitBounds(self.timeout_s, compile_s, (transport, dp_transport))
        self._setup = _Setup(
            plan, rank, executor, runtime, transport, slots, data_parallel, step_end, grad_norm, waits
        )
        return self._setup

    def _runtime(
        self, plan: Plan, rank: int, executor: Executor, transport: Any, slots: Slots
    ) -> RankRuntime:
        """The driver of ``plan`` on this rank (the training plan, or the forward-only one),
        its receive buffers from ``slots``."""
        lifetimes = [(lt.recv_index, lt.last_index) for lt in buffer_lifetimes(plan, rank)]
        preprocess_names = [p.name for p in executor.broadcast_tensors()]
        return RankRuntime(
            plan,
            rank,
            executor,
            transport,
            ReceiveBuffers(slots, lifetimes),
            preprocess_grads=lambda: [executor.grads()[n] for n in preprocess_names],
            sync_steps=self._sync_steps(),
            keep_preprocess_tape=self.keep_preprocess_tape,
            measure_tape=self.measure_tape,
        )

    def _loss_scale_base(self) -> float:
        """What the last stage's loss is multiplied by before any loss scaler: ``1/M`` with
        ``scale_grads``, else 1."""
        return 1.0 / self.micro_batch_num if self.scale_grads else 1.0

    def _check_plan_options(self) -> None:
        """Refuse now, not at the first ``run()``, the options the plan cannot take together
        (``backward="owner"`` without a trainable preprocess or a peer rank, ``body="1f1b"`` with
        more than one chunk per rank, ...), each error naming the alternative.

        This rank's stages already fix the geometry: rank ``r`` of ``P`` holds stages
        ``r, r + P, ...``, so ``V`` is how many it holds and ``P = num_stages / V``. A layout that
        does not fit is left to the set-up, which names it against the mesh.
        """
        num_stages, vpp, rank = self.stages[0].num_stages, len(self.stages), self.stages[0].stage_index
        if num_stages % vpp:
            return
        if (
            not self._transposes
            and rank == 0
            and self.preprocess_module is None
            and self.num_transpose_layers
        ):
            return  # a missing module, not an option: the first run() names it with the mesh's rank
        self._plan_config(num_stages // vpp, vpp, rank)

    def _plan_config(self, pp: int, vpp: int, rank: int) -> PlanConfig:
        """The plan's configuration on pipeline ``rank`` of ``pp``; raises ``PlanConfigError``
        (a ``ValueError``) naming the options that cannot go together and the alternative."""
        preprocess, layers = self._preprocess_kind(), self.num_transpose_layers
        if not self._transposes:
            if rank != 0:  # every preprocess step is on rank 0: this rank runs the body only
                preprocess, layers = "none", 0
            elif self.preprocess_module is None and layers > 0:
                raise ValueError(
                    f"num_transpose_layers={layers} but rank 0 has no preprocess_module: without "
                    "transposition rank 0 runs the preprocess, so it must pass it (other ranks may pass None)"
                )
        return PlanConfig(
            pp=pp,
            vpp=vpp,
            micro=self.micro_batch_num,
            preprocess=preprocess,
            num_preprocess_layers=layers,
            run_ahead=self.run_ahead,
            backward=self.backward,
            input=self.input,
            body=self.body,
            transpose=self._transposes,
        )

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
                f"pipeline rank {rank} of {pp} with {num_stages} stages must hold stages {expected} "
                f"(stage s lives on pipeline rank s mod {pp}), got {local}"
            )
        config = self._plan_config(pp, vpp, rank)
        module = self.preprocess_module if config.preprocess != "none" else None
        executor = create_executor(
            self.mode,
            {s.stage_index: s.submodule for s in self.stages},
            preprocess=module,
            loss_fn=self.loss_fn,
            last_stage=num_stages - 1,
            loss_scale=self._loss_scale_base(),
            # Only a trainable preprocess reads dL/d(stage 0 input); otherwise it is wasted work.
            first_stage_input_grads=config.trainable,
            recompute=self.recompute,
            token_loss=self.loss_reduction == "token",
            kernel_cache_size=self.kernel_cache_size,
            dynamic_shapes=self.shapes == "dynamic",
            jit_options=self.jit_options,
            split_backward=config.split_backward,
        )
        return build_plan(config), executor


def _option_property(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"The ``{name}`` option (read-only).")


for _name in option_names():
    if _name != "mesh":  # mesh: its own property above
        setattr(PipelineSchedule, _name, _option_property(_name))


class ScheduleMPipeTranspose(PipelineSchedule):
    """Interleaved 1F1B with the preprocess transposed onto idle warm-up ranks.

    Build it on every rank with the same arguments (its own stages aside); everything that can
    be checked locally is checked here, the rest at the first :meth:`run`.

    Args:
        stages: this rank's :class:`PipelineStage` chunks (stage ``s`` on pipeline rank ``s mod P``).
        micro_batch_num: micro-batches per step; the batch is cut into this many on dim 0.
        preprocess_module: the first ``num_transpose_layers`` layers of stage 0, built identically
            on every rank (trainable weights are broadcast from rank 0 each step, frozen ones never).
        num_transpose_layers: layers in ``preprocess_module``; ``0`` with no module is dataload only.
    """


class ScheduleInterleaved1F1B(PipelineSchedule):
    """The fair baseline: MPipe without transposition, the same API and executor otherwise.

    Interleaved 1F1B whose rank 0 runs the preprocess of micro ``m`` right before ``F 0.m``.
    A frozen preprocess runs forward only, once per micro-batch, nothing recomputed. A
    trainable one runs its forward under the tape and takes its gradient from that tape right
    after ``B 0.m``. Only rank 0 needs ``preprocess_module``: other ranks may pass it (it is
    ignored) or ``None``; nothing is broadcast and nothing is shipped, and the preprocess
    gradients live on rank 0. Comparing a run of this schedule with
    :class:`ScheduleMPipeTranspose` on the same model therefore isolates what transposition
    buys. On ranks other than 0 :attr:`plan` is built without the preprocess (all of its steps
    are rank 0's; their orders are the body either way).

    Do not fold the preprocess into stage 0 instead (a stage-0 chunk ``body(tower(x))``): a
    stage's backward recomputes or keeps the whole chunk, so a frozen tower would be run again
    in every backward, a cost no sensible user pays, and MPipe would look far better than it is.

    Args:
        stages, micro_batch_num: as for :class:`ScheduleMPipeTranspose`.
        preprocess_module: the preprocess, run by rank 0 only; other ranks may pass ``None``.
        num_transpose_layers: layers in ``preprocess_module`` (the same on every rank).

    The options ``run_ahead`` (``overflow``), ``backward``, ``input`` and
    ``keep_preprocess_tape`` need transposition and are refused with a ``TypeError``.
    """

    _transposes = False
