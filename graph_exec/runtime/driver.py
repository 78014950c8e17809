"""The per-rank driver: walks this rank's plan for one training step and runs each step.

Compute goes through the executor hooks, messages through the transport, receive buffers come
from the pool. The driver owns the per-step caches: they start empty, each step puts what a
later step takes, and they end empty. Any exception aborts the step — caches dropped, buffers
returned, peers told — and comes back as a :class:`PipelineStepError` naming rank, step and peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graph_exec.device import wait_for
from graph_exec.errors import GraphExecError, PipelineStepError
from graph_exec.executors.base import Executor
from graph_exec.runtime.buffers import ReceiveBuffers
from graph_exec.runtime.grad_reduce import StepContribution
from graph_exec.runtime.memory_account import MemoryAccount, held_bytes
from graph_exec.runtime.microbatch import MicroBatches
from graph_exec.runtime.state import StepCaches
from graph_exec.runtime.tape_calibration import TapeCalibration, tape_stats
from graph_exec.schedule import Plan, Step, StepKind
from graph_exec.schedule.routing import partner
from graph_exec.transport.buckets import PackedTensors


@dataclass(frozen=True)
class TimelineEvent:
    """One step as it really ran: seconds since the start of the training step."""

    rank: int
    step: str
    start: float
    end: float


class RankRuntime:
    """Runs one rank's order of a plan, one training step per :meth:`run` call.

    ``sync_steps`` makes every compute step wait for its results before the next step starts
    (and before its timeline entry is closed). A compiled MindSpore call may return before its
    graph has run; without the wait a step's time is billed to a later step, and on CPU the
    asynchronous dispatch was measured to be much *slower*: 2 ranks, graph mode, ``embed_lm``
    tiny 520/390 ms per step without the wait against 160/130 ms with it, ``vl_tower`` small
    800/780 against 390/388 ms. The schedules therefore turn it on for CPU by default.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        executor: Executor,
        transport: Any | None,
        buffers: ReceiveBuffers | None,
        *,
        preprocess_grads: Callable[[], list[Any]] | None = None,
        sync_steps: bool = False,
        keep_preprocess_tape: bool = False,
        measure_tape: bool = False,
    ) -> None:
        self.plan = plan
        self.rank = rank
        self.order = plan.orders[rank]
        self.executor = executor
        self.transport = transport
        self.buffers = buffers
        self.caches = StepCaches()
        self.timeline: list[TimelineEvent] = []
        #: What this rank held during the last step (``stats()["memory"]``).
        self.memory = MemoryAccount()
        #: Each local stage's tape, measured on the first step (``measure_tape=True``).
        self.tape = TapeCalibration() if measure_tape else None
        self._preprocess_grads = preprocess_grads
        self.sync_steps = sync_steps
        self._has_preprocess = plan.config.preprocess != "none"
        self._trainable = plan.config.trainable
        # Micro-batches whose trainable preprocess forward is recorded under the tape and whose
        # backward then runs the recorded bprop instead of a recompute.
        self._taped_micros = _taped_preprocess_micros(plan, rank, keep_preprocess_tape)
        self._last_stage = plan.config.last_stage
        # body "zb": each backward is I (input gradients now) + W (weight gradients later).
        self._split = plan.config.split_backward
        # A forward-only plan (evaluation) runs the forward hooks that record and keep nothing.
        self._forward_only = plan.config.forward_only
        self._batch: MicroBatches | None = None
        self._index = 0
        self._contribution: StepContribution | None = None
        self._preprocess_params: PackedTensors | None = None
        self._handlers: dict[StepKind, Callable[[Step], None]] = {
            StepKind.F: self._forward,
            StepKind.B: self._backward,
            StepKind.I: self._backward,
            StepKind.W: self._weight_backward,
            StepKind.FSEND: self._send_activations,
            StepKind.BSEND: self._send_input_grads,
            StepKind.FRECV: self._receive_activations,
            StepKind.BRECV: self._receive_cotangents,
            StepKind.BCAST: self._broadcast,
            StepKind.TFWD: self._preprocess_forward,
            StepKind.OUTSEND: self._send_preprocess_outputs,
            StepKind.OUTRECV: self._receive_preprocess_outputs,
            StepKind.INSEND: self._ship_input,
            StepKind.INRECV: self._receive_input,
            StepKind.TBWD: self._preprocess_backward_central,
            StepKind.GRADSEND: self._send_preprocess_grads,
            StepKind.GRADRECV_BWD: self._preprocess_backward_owner,
            StepKind.GRADREDUCE: self._grad_reduce,
        }

    # -- the walk --------------------------------------------------------------------------

    def run(
        self, batch: MicroBatches, tag: int = 0, describe_tag: Callable[[int], str] = str
    ) -> dict[int, Any]:
        """Run this rank's whole order on ``batch``; returns the losses by micro-batch index
        (on the last stage's rank; of a forward-only plan without labels: its outputs).
        ``tag`` (what the step's data depends on beyond the plan, e.g. the tower placement)
        travels in every transfer and must match the peers' (``describe_tag`` names one in
        the error)."""
        leftovers = self.caches.leftovers()
        if self.executor.kept():
            leftovers.append(f"executor kept {list(self.executor.kept())}")
        if leftovers:
            raise GraphExecError(f"rank {self.rank}: data left from a previous step: {'; '.join(leftovers)}")
        self._batch = batch
        if self.transport is not None:
            self.transport.set_step_tag(tag, describe_tag)
        self.timeline = []
        self.executor.begin_step()
        self.memory.begin_step()
        if self.tape is not None:
            self.tape.begin_step()
        if any(step.kind is StepKind.GRADREDUCE for step in self.order) and self._preprocess_grads:
            self._contribution = StepContribution(PackedTensors(self._preprocess_grads()))
        origin = time.perf_counter()
        for index, step in enumerate(self.order):
            self._index = index
            start = time.perf_counter()
            try:
                self._handlers[step.kind](step)
                self._account()
                if self.buffers is not None and self.buffers.due(self._index):
                    self.buffers.release_after(self._index)
            except Exception as exc:
                self.abort(f"step {step.token} raised {type(exc).__name__}: {exc}")
                raise PipelineStepError(self.rank, step.token, self.plan.peer(self.rank, step), exc) from exc
            except BaseException:
                self.abort(f"step {step.token} was interrupted")
                raise
            self.timeline.append(
                TimelineEvent(self.rank, step.token, start - origin, time.perf_counter() - origin)
            )
        if self.tape is not None:
            self.tape.end_step()
        losses = dict(self.caches.losses)
        self.caches.losses.clear()
        leftovers = self.caches.leftovers()
        if leftovers or self.executor.kept():
            self.abort("plan left data behind")
            raise GraphExecError(
                f"rank {self.rank}: the plan left data behind (a runtime bug): "
                f"{'; '.join(leftovers)} executor kept {list(self.executor.kept())}"
            )
        return losses

    def abort(self, reason: str) -> None:
        """Drop every cache, return every buffer and tell the peers (best effort; the transport
        then lets this rank's abandoned communication end). While a timed-out communication
        call may still run, no MindSpore op is started here."""
        self.caches.clear()
        self.executor.drop_kept(consume=self.transport is None or not self.transport.call_in_flight)
        self._contribution = None
        if self.buffers is not None:
            self.buffers.release_all()
        if self.transport is not None:
            self.transport.abort(reason)

    def _account(self) -> None:
        """Fold the step just run into the memory account, before its receive buffers go back
        (what a step last reads counts through that step, as in the memory model)."""
        held = self.executor.held_state()
        memory = self.memory
        memory.sync("activations", held.forwards)
        memory.sync("preprocess_tapes", held.preprocess)
        memory.sync("held_weight_gradients", held.weight_grads, held_bytes)
        memory.observe(0 if self.buffers is None else self.buffers.held_bytes)

    def memory_prediction(self, recompute: bool) -> dict[str, Any]:
        """The tape keys of ``stats()["memory"]`` (:func:`tape_stats`), after a step."""
        return tape_stats(self.tape, self.plan, self.rank, recompute, self.memory.held_by_step)

    def _account_fused(self, stage: int, micro: int, inputs: tuple[Any, ...]) -> None:
        """The last stage's fused step keeps nothing after it: its input counts during it."""
        self.memory.hold("activations", (stage, micro), inputs)
        self.memory.release_after_step("activations", (stage, micro))

    # -- messages --------------------------------------------------------------------------

    def _send(self, step: Step, tensors: tuple[Any, ...]) -> None:
        self.transport.send(tensors, self.plan.peer(self.rank, step), step.token)

    def _recv(self, step: Step) -> tuple[Any, ...]:
        alloc = {} if self.buffers is None else {"alloc": self.buffers.allocator(self._index)}
        return self.transport.recv(self.plan.peer(self.rank, step), partner(step).token, **alloc)

    def _send_activations(self, step: Step) -> None:
        self._send(step, self.caches.outputs.pop((step.stage, step.micro)))

    def _send_input_grads(self, step: Step) -> None:
        self._send(step, self.caches.input_grads.pop((step.stage, step.micro)))

    def _send_preprocess_outputs(self, step: Step) -> None:
        self._send(step, self.caches.preprocess_outputs.pop(step.micro))
        self.memory.release_after_step("preprocess_outputs", step.micro)

    def _send_preprocess_grads(self, step: Step) -> None:
        self._send(step, self.caches.preprocess_grads.pop(step.micro))

    def _receive_activations(self, step: Step) -> None:
        self.caches.body_inputs[(step.stage, step.micro)] = self._recv(step)

    def _receive_cotangents(self, step: Step) -> None:
        self.caches.cotangents[(step.stage, step.micro)] = self._recv(step)

    def _receive_preprocess_outputs(self, step: Step) -> None:
        self.caches.body_inputs[(0, step.micro)] = self._recv(step)

    def _broadcast(self, step: Step) -> None:
        if self._preprocess_params is None:  # the executor's list is fixed: pack it once
            self._preprocess_params = PackedTensors(self.executor.broadcast_tensors())
        self._preprocess_params.broadcast(self.transport, src=0)

    def _grad_reduce(self, step: Step) -> None:
        if self._contribution is not None:
            self._contribution.all_reduce(self.transport)
            self._contribution = None

    def _settle(self, *results: Any) -> None:
        """With ``sync_steps``: wait until a compute step's results exist (no-op otherwise).

        Waits in the order given: callers pass input gradients before the loss (waiting on the
        loss of a fused step first was measured 3-5x slower). A step that returns nothing (a
        backward whose inputs take no gradient, a preprocess backward) waits on the gradient
        accumulators it wrote into.
        """
        if not self.sync_steps:
            return
        wait_for([t for t in results if t is not None] or self.executor.grads().values())

    # -- body compute ----------------------------------------------------------------------

    def _stage_input(self, stage: int, micro: int) -> tuple[Any, ...]:
        if stage == 0 and not self.plan.config.mpipe:
            return self._batch.inputs[micro]  # no preprocess and nothing shipped: straight from the batch
        if stage == 0:  # rank 0's own preprocess output (if it made this one) is read now
            self.memory.release_after_step("preprocess_outputs", micro)
        return self.caches.body_inputs.pop((stage, micro))

    def _forward(self, step: Step) -> None:
        stage, micro = step.stage, step.micro
        inputs = self._stage_input(stage, micro)
        if self._forward_only:
            self._forward_only_step(stage, micro, inputs)
            return
        labels = () if self._batch.labels is None else self._batch.labels[micro]
        if self.tape is not None:
            last = stage == self._last_stage
            self.tape.before_forward(self.executor, stage, inputs, labels if last else None, self._split)
        if stage == self._last_stage:
            loss, grads = self.executor.last_stage_step(
                stage, micro, inputs, labels, hold_weight_grads=self._split
            )
            self._account_fused(stage, micro, inputs)
            self._settle(*grads, *_flat(loss))
            self.caches.losses[micro] = loss
            self.caches.input_grads[(stage, micro)] = grads  # the B (I) step routes them
            return
        outputs = self.executor.stage_forward(stage, micro, inputs)
        self._settle(*outputs)
        if self.plan.stage_rank(stage + 1) == self.rank:
            self.caches.body_inputs[(stage + 1, micro)] = outputs  # next chunk is local (P = 1)
        else:
            self.caches.outputs[(stage, micro)] = outputs

    def _forward_only_step(self, stage: int, micro: int, inputs: tuple[Any, ...]) -> None:
        """``F s.m`` of a forward-only plan: nothing taped, no gradient touched; the last stage
        leaves its loss (with labels) or its outputs as the micro-batch's result."""
        if stage == self._last_stage:
            labels = None if self._batch.labels is None else self._batch.labels[micro]
            result = self.executor.last_stage_forward(stage, inputs, labels)
            self._settle(*_flat(result))
            self.caches.losses[micro] = result
            return
        outputs = self.executor.stage_forward_only(stage, inputs)
        self._settle(*outputs)
        if self.plan.stage_rank(stage + 1) == self.rank:
            self.caches.body_inputs[(stage + 1, micro)] = outputs
        else:
            self.caches.outputs[(stage, micro)] = outputs

    def _backward(self, step: Step) -> None:
        """``B s.m``, or ``I s.m`` of the split backward: the input gradients, routed upstream
        (to the preprocess backward after stage 0); ``I`` leaves the weight gradients held in
        the executor for ``W s.m``."""
        stage, micro = step.stage, step.micro
        if stage == self._last_stage:
            grads = self.caches.input_grads.pop((stage, micro))  # computed by the fused step
        else:
            backward = self.executor.stage_backward_input if self._split else self.executor.stage_backward
            grads = backward(stage, micro, self.caches.cotangents.pop((stage, micro)))
            self._settle(*grads)
        if stage == 0:
            if self._trainable:
                self.caches.preprocess_grads[micro] = grads
        elif self.plan.stage_rank(stage - 1) == self.rank:
            self.caches.cotangents[(stage - 1, micro)] = grads
        else:
            self.caches.input_grads[(stage, micro)] = grads

    def _weight_backward(self, step: Step) -> None:
        """``W s.m``: accumulate the weight gradients ``I s.m`` (the last stage: its fused
        ``F s.m``) held."""
        self.executor.stage_backward_weight(step.stage, step.micro)
        self._settle()

    # -- preprocess ------------------------------------------------------------------------

    def _preprocess_forward(self, step: Step) -> None:
        micro = step.micro
        inputs = self._batch.inputs[micro]
        if micro in self._taped_micros:
            outputs = self.executor.preprocess_forward_taped(
                _preprocess_key(micro), inputs, self._batch.kwargs[micro]
            )
        elif self._has_preprocess:
            outputs = self.executor.preprocess_forward(inputs, self._batch.kwargs[micro])
        else:
            outputs = inputs
        self._settle(*outputs)
        self.memory.hold("preprocess_outputs", micro, outputs)
        if self.rank == 0:
            self.caches.body_inputs[(0, micro)] = outputs
        else:
            self.caches.preprocess_outputs[micro] = outputs

    def _ship_input(self, step: Step) -> None:
        kwargs = self._batch.kwargs[step.micro]
        self._send(step, (*self._batch.inputs[step.micro], *(kwargs[k] for k in sorted(kwargs))))

    def _receive_input(self, step: Step) -> None:
        received = self._recv(step)
        count = len(self._batch.inputs[step.micro])
        keys = sorted(self._batch.kwargs[step.micro])
        self.caches.shipped_inputs[step.micro] = (
            received[:count],
            dict(zip(keys, received[count:], strict=True)),
        )

    def _preprocess_backward_central(self, step: Step) -> None:
        micro = step.micro
        if micro in self._taped_micros:
            self.executor.preprocess_backward_taped(
                _preprocess_key(micro), self.caches.preprocess_grads.pop(micro)
            )
            self._settle()
            return
        if micro in self.caches.shipped_inputs:
            inputs, kwargs = self.caches.shipped_inputs.pop(micro)
        else:
            inputs, kwargs = self._batch.inputs[micro], self._batch.kwargs[micro]
        self.executor.preprocess_backward(inputs, kwargs, self.caches.preprocess_grads.pop(micro))
        self._settle()

    def _preprocess_backward_owner(self, step: Step) -> None:
        micro = step.micro
        cotangents = self._recv(step)
        if micro in self._taped_micros:
            self.executor.preprocess_backward_taped(_preprocess_key(micro), cotangents)
        else:
            self.executor.preprocess_backward(
                self._batch.inputs[micro], self._batch.kwargs[micro], cotangents
            )
        self._settle()


def _flat(result: Any) -> tuple[Any, ...]:
    """A loss, a per-token ``(sum, count)`` pair or a stage's outputs, as a tuple of tensors."""
    return result if isinstance(result, tuple) else (result,)


def _taped_preprocess_micros(plan: Plan, rank: int, keep_tape: bool) -> frozenset[int]:
    """The micro-batches whose preprocess forward this rank records under the tape.

    Without transposition rank 0 runs every preprocess forward itself, so a trainable one keeps
    its tape for the ``TBWD`` right after ``B 0.m`` (the fair baseline). With transposition the
    contract recomputes the preprocess in its backward; ``keep_tape`` (opt-in) records every
    ``TFWD`` whose backward (``TBWD`` or ``GRADrecv+bwd``) runs on this same rank, trading the
    preprocess activations of those micro-batches, held from ``TFWD`` to the backward, for the
    recompute.
    """
    if not plan.config.trainable or (plan.config.transpose and not keep_tape):
        return frozenset()
    order = plan.orders[rank]
    forwards = {step.micro for step in order if step.kind is StepKind.TFWD}
    backwards = {step.micro for step in order if step.kind in (StepKind.TBWD, StepKind.GRADRECV_BWD)}
    return frozenset(forwards & backwards)


def _preprocess_key(micro: int) -> tuple[str, int]:
    """Where the executor keeps the taped preprocess forward of ``micro``."""
    return ("preprocess", micro)
