"""What a schedule builds at its first ``run()``: the plan, the executor, the transports and the
components that wire a training step (data parallelism, optimizer sharding, tied pairs, the
global norm, loss scaling), each its own module; this one only puts them together.

Split from :mod:`graph_exec.runtime.schedules` so the schedule stays its public methods: the
order of the set-up matters and is said once, here. Every rank first builds what it can alone
(the plan and executor; a bad layout or option is an error), then every rank hears every other
rank's outcome and checks that all were set up alike before any component sends a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graph_exec.errors import CommunicationNotInitializedError
from graph_exec.executors import Executor, create_executor
from graph_exec.runtime.buffers import ReceiveBuffers, Slots, receive_slots
from graph_exec.runtime.data_parallel import DataParallelGrads
from graph_exec.runtime.driver import RankRuntime
from graph_exec.runtime.grad_norm import GlobalGradNorm, counted_names
from graph_exec.runtime.handshake import check_ranks_agree, share_setup_outcome
from graph_exec.runtime.loss_scaling import LossScale
from graph_exec.runtime.optimizer_sharding import OptimizerSharding, check_enough_to_share
from graph_exec.runtime.setup_facts import pipeline_facts, replica_facts
from graph_exec.runtime.step_end import StepEnd
from graph_exec.runtime.tied import set_up_ties
from graph_exec.runtime.wait_bounds import WaitBounds, compile_timeout
from graph_exec.schedule import Plan, PlanConfig, buffer_lifetimes, build_plan


@dataclass
class Setup:
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
    sharding: OptimizerSharding | None = None  #: with optimizer_sharding=True
    mesh: Any = None  #: the mesh set up on (a one-pipeline mesh over the world without the option)


@dataclass
class _Links:
    """The mesh this rank set up on and its two transports (``None`` where the group is one rank)."""

    mesh: Any
    pipeline: Any | None
    replicas: Any | None

    @property
    def groups(self) -> list[Any]:
        return [t for t in (self.pipeline, self.replicas) if t is not None]


def set_up(sched: Any) -> Setup:
    """Build ``sched``'s set-up on this rank, every rank together (see the module docstring)."""
    compile_s = compile_timeout(sched.compile_timeout_s, sched.timeout_s)
    links = _links(sched, compile_s)
    plan, executor = _agreed_build(sched, links)
    data_parallel = _data_parallel(sched, executor, links.replicas)
    mesh = links.mesh
    sharding = (
        OptimizerSharding(
            links.replicas, sched.trainable_params(), mesh.dp_rank, mesh.dp_size, sched.dp_bucket_bytes
        )
        if sched.optimizer_sharding
        else None
    )
    grad_norm, tied = _norm_and_ties(sched, executor, links)
    step_end = StepEnd(
        executor,
        (links.pipeline, links.replicas),
        mesh.dp_size,
        LossScale(
            sched.loss_scaler,
            loss_scale_base(sched),
            compiled=sched.mode == "graph",
            jit_options=sched.jit_options,
        ),
        sched.loss_reduction == "token",
        data_parallel,
        tied,
        grad_norm,
    )
    slots = receive_slots(sched.buffer_cache_bytes)
    runtime = rank_runtime(sched, plan, mesh.pp_rank, executor, links.pipeline, slots)
    waits = WaitBounds(sched.timeout_s, compile_s, (links.pipeline, links.replicas))
    parts = (plan, mesh.pp_rank, executor, runtime, links.pipeline, slots, data_parallel, step_end)
    return Setup(*parts, grad_norm, waits, sharding=sharding, mesh=mesh)


def _links(sched: Any, compile_s: float) -> _Links:
    """The mesh and its transports; refuses a rank holding part of the stages without communication."""
    from graph_exec.transport import LAUNCH_HINT, Transport, bound_backend_waits, is_initialized
    from graph_exec.transport.mesh import DeviceMesh

    num_stages = sched.stages[0].num_stages
    local = [s.stage_index for s in sched.stages]
    if sched.options.mesh is None and not is_initialized() and local != list(range(num_stages)):
        raise CommunicationNotInitializedError(
            f"this rank holds stages {local} of {num_stages}, so other ranks hold the rest, but "
            f"MindSpore communication is not initialised: {LAUNCH_HINT}"
        )
    if is_initialized():  # before the first message (the mesh check); a lone process sends none
        bound_backend_waits(compile_s)  # the longest wait; the transports bound each step's
    mesh = sched.options.mesh if sched.options.mesh is not None else DeviceMesh()
    kept = sched.buffer_cache_bytes

    def transport(group: Any, size: int) -> Any | None:
        return Transport(timeout_s=sched.timeout_s, group=group, frame_cache_bytes=kept) if size > 1 else None

    return _Links(mesh, transport(mesh.pp, mesh.pp_size), transport(mesh.dp, mesh.dp_size))


def _agreed_build(sched: Any, links: _Links) -> tuple[Plan, Executor]:
    """This rank's plan and executor, once every rank built its own and all agree: a rank whose
    build failed makes every rank raise, before any component sends a message."""
    error: Exception | None = None
    plan = executor = None
    try:
        plan, executor = build_local(sched, links.mesh.pp_size, links.mesh.pp_rank)
        if sched.optimizer_sharding:
            check_enough_to_share(sched.trainable_params(), links.mesh.dp_size)
    except (ValueError, TypeError) as exc:  # bad set-up: every rank must hear of it
        error = exc
    if not links.groups:
        if error is not None:
            raise error
        return plan, executor
    share_setup_outcome(links.groups, error)
    agree = [(links.pipeline, pipeline_facts(sched, plan.config))] if links.pipeline is not None else []
    if links.replicas is not None:
        agree.append((links.replicas, replica_facts(sched, plan.config)))
    check_ranks_agree(agree)
    return plan, executor


def _data_parallel(sched: Any, executor: Executor, replicas: Any | None) -> DataParallelGrads | None:
    """Gradient averaging over the replicas, every replica starting from replica 0's values."""
    if replicas is None:
        return None
    params = sched.trainable_params()
    data_parallel = DataParallelGrads(
        replicas, params, lambda: [executor.grads()[p.name] for p in params], sched.dp_bucket_bytes
    )
    data_parallel.start_in_sync()
    return data_parallel


def _norm_and_ties(sched: Any, executor: Executor, links: _Links) -> tuple[GlobalGradNorm, Any]:
    """The global gradient norm (each tied pair counted once) and the tied pairs, set up after
    the replicas took replica 0's values (those are the values the tie check compares)."""
    trains = {p.name: p for p in sched.trainable_params()}
    stage_names = {p.name for s in sched.stages for p in s.submodule.trainable_params()}
    tied = None
    if sched.tied_parameters:
        tied = set_up_ties(
            sched.tied_parameters, trains, stage_names, executor, links.pipeline, links.mesh, sched.timeout_s
        )
    rank, pp = links.mesh.pp_rank, links.mesh.pp_size
    counted = counted_names(list(trains), stage_names, rank, [b for _, b in sched.tied_parameters])
    return GlobalGradNorm(executor, counted, links.pipeline, rank, pp), tied


def rank_runtime(
    sched: Any, plan: Plan, rank: int, executor: Executor, transport: Any, slots: Slots
) -> RankRuntime:
    """The driver of ``plan`` on this rank (the training plan, or the forward-only one), its
    receive buffers from ``slots``."""
    lifetimes = [(lt.recv_index, lt.last_index) for lt in buffer_lifetimes(plan, rank)]
    preprocess_names = [p.name for p in executor.broadcast_tensors()]
    return RankRuntime(
        plan,
        rank,
        executor,
        transport,
        ReceiveBuffers(slots, lifetimes),
        preprocess_grads=lambda: [executor.grads()[n] for n in preprocess_names],
        sync_steps=_sync_steps(sched),
        keep_preprocess_tape=sched.keep_preprocess_tape,
        measure_tape=sched.measure_tape,
    )


def loss_scale_base(sched: Any) -> float:
    """What the last stage's loss is multiplied by before any loss scaler: ``1/M`` with
    ``scale_grads``, else 1."""
    return 1.0 / sched.micro_batch_num if sched.scale_grads else 1.0


def _sync_steps(sched: Any) -> bool:
    if sched.sync_steps is not None:
        return bool(sched.sync_steps)
    from graph_exec.device import policy

    return policy().sync_steps_default


def check_plan_options(sched: Any) -> None:
    """Refuse at construction, not at the first ``run()``, the options the plan cannot take
    together (``backward="owner"`` without a trainable preprocess or a peer rank, ``body="1f1b"``
    with more than one chunk per rank, ...), each error naming the alternative.

    This rank's stages already fix the geometry: rank ``r`` of ``P`` holds stages
    ``r, r + P, ...``, so ``V`` is how many it holds and ``P = num_stages / V``. A layout that
    does not fit is left to the set-up, which names it against the mesh.
    """
    num_stages, vpp, rank = sched.stages[0].num_stages, len(sched.stages), sched.stages[0].stage_index
    if num_stages % vpp:
        return
    if not sched._transposes and rank == 0 and sched.preprocess_module is None and sched.num_transpose_layers:
        return  # a missing module, not an option: the first run() names it with the mesh's rank
    plan_config(sched, num_stages // vpp, vpp, rank)


def plan_config(sched: Any, pp: int, vpp: int, rank: int) -> PlanConfig:
    """The plan's configuration on pipeline ``rank`` of ``pp``; raises ``PlanConfigError``
    (a ``ValueError``) naming the options that cannot go together and the alternative."""
    preprocess, layers = sched._preprocess_kind(), sched.num_transpose_layers
    if not sched._transposes:
        if rank != 0:  # every preprocess step is on rank 0: this rank runs the body only
            preprocess, layers = "none", 0
        elif sched.preprocess_module is None and layers > 0:
            raise ValueError(
                f"num_transpose_layers={layers} but rank 0 has no preprocess_module: without "
                "transposition rank 0 runs the preprocess, so it must pass it (other ranks may pass None)"
            )
    return PlanConfig(
        pp=pp,
        vpp=vpp,
        micro=sched.micro_batch_num,
        preprocess=preprocess,
        num_preprocess_layers=layers,
        run_ahead=sched.run_ahead,
        backward=sched.backward,
        input=sched.input,
        body=sched.body,
        transpose=sched._transposes,
    )


def build_local(sched: Any, pp: int, rank: int) -> tuple[Plan, Executor]:
    """The plan and executor of this rank; raises ``ValueError`` if the stages do not fit."""
    num_stages = sched.stages[0].num_stages
    local = [s.stage_index for s in sched.stages]
    if num_stages % pp:
        raise ValueError(f"num_stages={num_stages} is not a multiple of the {pp} pipeline ranks")
    vpp = num_stages // pp
    expected = [rank + k * pp for k in range(vpp)]
    if local != expected:
        raise ValueError(
            f"pipeline rank {rank} of {pp} with {num_stages} stages must hold stages {expected} "
            f"(stage s lives on pipeline rank s mod {pp}), got {local}"
        )
    config = plan_config(sched, pp, vpp, rank)
    module = sched.preprocess_module if config.preprocess != "none" else None
    executor = create_executor(
        sched.mode,
        {s.stage_index: s.submodule for s in sched.stages},
        preprocess=module,
        loss_fn=sched.loss_fn,
        last_stage=num_stages - 1,
        loss_scale=loss_scale_base(sched),
        # Only a trainable preprocess reads dL/d(stage 0 input); otherwise it is wasted work.
        first_stage_input_grads=config.trainable,
        recompute=sched.recompute,
        token_loss=sched.loss_reduction == "token",
        kernel_cache_size=sched.kernel_cache_size,
        dynamic_shapes=sched.shapes == "dynamic",
        jit_options=sched.jit_options,
        split_backward=config.split_backward,
    )
    return build_plan(config), executor
