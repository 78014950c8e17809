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
from dataclasses import replace
from functools import partial
from typing import Any

from graph_exec import checks
from graph_exec.errors import GraphExecError
from graph_exec.runtime.driver import TimelineEvent
from graph_exec.runtime.grad_norm import check_max_norm, check_norm_type
from graph_exec.runtime.memory_account import optimizer_state_bytes
from graph_exec.runtime.microbatch import (
    MicroBatches,
    given_micro_batches,
    in_user_order,
    permuted,
    split_batch,
)
from graph_exec.runtime.optimizer_sharding import (
    check_enough_to_share,
    check_shardable,
    owned_params,
)
from graph_exec.runtime.options import (
    ScheduleOptions,
    option_names,
    options_doc,
    options_from_keywords,
    schedule_signature,
)
from graph_exec.runtime.param_names import check_unique_parameter_names
from graph_exec.runtime.schedule_stats import schedule_stats
from graph_exec.runtime.setup import Setup, check_plan_options, rank_runtime, set_up
from graph_exec.runtime.stage import PipelineStage
from graph_exec.runtime.step_end import per_token_losses
from graph_exec.runtime.tied import check_local
from graph_exec.runtime.tower_placement import TowerPlacement, describe_tag, placement_tag
from graph_exec.schedule import Plan, PlanConfig, build_plan, placement


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
        check_plan_options(self)
        self._placement = TowerPlacement(self.micro_batch_num, self.tower_order)
        self._mesh: Any = None  # the mesh the first run() set up on
        self._setup: Setup | None = None
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
                setup.evaluation = rank_runtime(
                    self, plan, setup.rank, setup.executor, setup.transport, setup.slots
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
                if setup.sharding is not None:  # every replica takes each owner's new values
                    setup.sharding.gather()
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

    def optimizer_params(self) -> list[Any]:
        """The parameters to build this rank's optimizer over: :meth:`trainable_params`, or with
        ``optimizer_sharding=True`` this replica's share of them
        (:mod:`graph_exec.runtime.optimizer_sharding`). Available before the first ``run()``;
        raises ``ValueError`` where a replica would own nothing (fewer parameters than replicas)."""
        params = self.trainable_params()
        if not self.optimizer_sharding:
            return params
        check_enough_to_share(params, self.options.mesh.dp_size)
        return owned_params(params, self.options.mesh.dp_rank, self.options.mesh.dp_size)

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
        """Counters for benchmarks: compilations, the kernel cache, receive buffers, messages, data
        parallelism, optimizer sharding and ``memory`` (:mod:`graph_exec.runtime.schedule_stats`;
        ``docs/api.md`` lists every key)."""
        return schedule_stats(self, self._require_setup("stats()"))

    def _note_optimizer(self, optimizer: Any, params: Sequence[Any]) -> None:
        """Remember the bytes of the state of the optimizer :meth:`step` applies (once per optimizer)."""
        if self._optimizer_state is None or self._optimizer_state[0] != id(optimizer):
            self._optimizer_state = (id(optimizer), optimizer_state_bytes(optimizer, params))

    # -- setup -----------------------------------------------------------------------------

    def _require_setup(self, what: str) -> Setup:
        if self._setup is None:
            raise GraphExecError(f"{what} is available after the first run()")
        return self._setup

    def _require_step(self, what: str) -> Setup:
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
                "sched.optimizer_params()"
            )
        if self.optimizer_sharding:
            owned = {p.name for p in self.optimizer_params()}
            others = [p.name for p in params if p.name not in owned]
            if others:
                raise ValueError(
                    f"with optimizer_sharding=True the optimizer updates {others[:4]}, which another "
                    "replica owns: build it over sched.optimizer_params()"
                )
            check_shardable(optimizer, params)
        return tuple(params)

    def _preprocess_kind(self) -> str:
        if self.preprocess_module is None:
            return "none"
        return "trainable" if self.preprocess_module.trainable_params() else "frozen"

    def _set_up(self) -> Setup:
        """Set up at the first ``run()`` (:mod:`graph_exec.runtime.setup`), every rank together."""
        self._setup = set_up(self)
        self._mesh = self._setup.mesh
        return self._setup


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
