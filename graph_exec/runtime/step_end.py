"""What happens to the gradients between the last plan step and the caller getting them back.

In order, after :class:`~graph_exec.runtime.driver.RankRuntime` has walked the plan:

1. **Data-parallel average** of every accumulator (:mod:`graph_exec.runtime.data_parallel`).
2. **Tied pairs** summed between the ranks holding them (:mod:`graph_exec.runtime.tied`).
3. **The step's facts, agreed by the mesh in one meeting.** With a loss scaler every rank
   removes the scale (``1 / scale``, one float32 multiplication in place) and checks the
   result for infinities and NaNs in the same pass over its gradients (the check of
   ``mindspore.amp.all_finite``); with ``loss_reduction="token"`` the last stage's rank adds up
   its micro-batches' token counts; once the schedule has clipped
   (:mod:`graph_exec.runtime.grad_norm`), every rank adds its share of the global norm in its
   own slot. One vector, one SUM all-reduce over the pipeline group (and the two facts once
   more over the data-parallel group; each rank's value is counted once: the pattern of
   :func:`~graph_exec.runtime.handshake.share_setup_outcome`), so every rank of the mesh sees
   the same overflow verdict, the same global token count and the same norm. The check comes
   after steps 1-2, so the gradients it sees are the ones the optimizer will.
   **The facts are exact**: the vector is int64 (the CPU backend refuses float64 collectives);
   the overflow flags are integers, and the token count and the norm shares travel as the
   bits of a float64, one writer per slot (the last stage's rank for its pipeline's count,
   then one slot per replica; each rank for its norm share) with integer zeros added: every
   rank then adds the slots on the host in the same order (``math.fsum``). A count is exact up
   to 2**53 (float32 rounded above 2**24), the norm keeps the float64 of the host's pass.
4. **Per-token normalisation:** ``D / N`` turns the replicas' mean of token-loss *sums* into
   the gradient of ``Σ sums / N`` (``N``, the global token count, at least 1: a batch without
   tokens gives zero gradients); the norm of step 3 is multiplied by the same factor. Both
   factors are applied even after an overflow (the values are not used then).
5. **Earlier gradients back.** Gradients accumulate across ``run()`` calls until
   ``zero_grad()``, but steps 1-4 must see only this step's: when the accumulators held
   earlier gradients, :meth:`StepEnd.begin` set them aside (a copy, then zeros) and they are
   added back here, untouched by this step's factor whatever it is. (Multiplying the earlier
   gradients by the scale before the step and unscaling everything after would be exact only
   for a power-of-two scale, and cannot express the per-token factor, known only after the
   step.) Each factor is one float32 multiplication: exact for a power-of-two scale (a
   ``DynamicLossScaler`` started at one stays one) and within a rounding of ``1/scale``
   otherwise (``StaticLossScaler(1000)``, tested). No norm rides along in such a step (it
   would miss the earlier gradients).
6. **The scaler adjusted** with the agreed verdict, identically on every rank.

Nothing here runs for a schedule without scaler, per-token loss or tied pairs beyond the
data-parallel average it always did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from graph_exec.runtime.data_parallel import DataParallelGrads
from graph_exec.runtime.grad_norm import GlobalGradNorm, norm_slots
from graph_exec.runtime.loss_scaling import LossScale
from graph_exec.runtime.tied import TiedGradients
from graph_exec.runtime.update_gate import UpdateGate


class StepEnd:
    """The end of every step on one rank (see the module docstring).

    ``groups``: the transports of this rank's pipeline and data-parallel groups (``None`` where
    the group has one rank); ``dp_size``: the number of replicas; ``grad_norm``: this rank's side
    of the global norm, whose share rides in step 3. :attr:`gate` decides, after the step, whether
    its gradients may change the weights (:mod:`graph_exec.runtime.update_gate`).
    """

    def __init__(
        self,
        executor: Any,
        groups: tuple[Any | None, Any | None],
        dp_size: int,
        loss_scale: LossScale,
        token_loss: bool,
        data_parallel: DataParallelGrads | None,
        tied: TiedGradients | None,
        grad_norm: GlobalGradNorm,
    ) -> None:
        self.executor = executor
        self._pipeline, self._replicas = groups
        self._dp_size = dp_size
        self.loss_scale = loss_scale
        self._token_loss = token_loss
        self._data_parallel = data_parallel
        self._tied = tied
        self._grad_norm = grad_norm
        self._checks_overflow = loss_scale.scaler is not None
        #: Whether this step's gradients must be post-processed on their own (steps 2-4).
        self.own_gradients = self._checks_overflow or token_loss or tied is not None
        self._set_aside = False
        self._scale = 1.0  # the loss scaler's value for this step, read by begin()
        self.gate = UpdateGate(executor, groups, grad_norm, self._checks_overflow)

    def begin(self, accumulated: bool) -> None:
        """Before the plan runs: give the last stage this step's loss scale, and set earlier
        gradients aside when ``accumulated`` (the accumulators are not zero) and they must be."""
        if self._checks_overflow:
            self._scale = self.loss_scale.value()  # what this step's end removes again
            self.executor.set_loss_scale(self.loss_scale.base * self._scale)
        self._set_aside = accumulated and self.own_gradients
        if self._set_aside:
            self.executor.set_aside_grads()

    def finish(self, results: Mapping[int, Any]) -> tuple[dict[int, Any], bool | None]:
        """After the plan ran: steps 1-6 of the module docstring. Returns the per-micro-batch
        losses (``sum / count`` for per-token loss) and the mesh's overflow verdict (``True``:
        every gradient finite; ``None`` without a loss scaler: nothing was checked)."""
        losses, tokens = per_token_losses(results) if self._token_loss else (dict(results), None)
        if self._data_parallel is not None:
            self._data_parallel.average()
        if self._tied is not None:
            self._tied.sum_gradients()
        norm_type = self._grad_norm.riding()
        if self._set_aside:
            norm_type = None
        finite = None
        if self._checks_overflow or self._token_loss:
            finite, total_tokens, norm = self._agree(tokens, norm_type)
            if self._token_loss:
                factor = self._dp_size / max(total_tokens, 1.0)  # float64 on the host
                self.executor.multiply_grads(factor)
                norm = None if norm is None else norm * factor
            if norm is not None:
                self._grad_norm.learn(norm_type, norm)
        if self._set_aside:
            self.executor.add_back_grads()
            self._set_aside = False
        if finite is not None:
            self.loss_scale.adjust(finite)
        return losses, finite

    def abandon(self) -> None:
        """A step failed: nothing is added back (the schedule refuses further steps anyway)."""
        self._set_aside = False

    def _agree(self, tokens: Any | None, norm_type: float | None) -> tuple[bool | None, float, float | None]:
        """Step 3 (the unscaling included):
        ``(every gradient finite over the mesh, global token count, the pipeline's norm of
        the gradients as they now are, None without norm_type)``."""
        import mindspore as ms

        norm = self._grad_norm
        if self._checks_overflow:
            finite, part = self.executor.unscale_and_check(1.0 / self._scale, norm.counted, norm_type)
        else:
            finite, part = True, (0.0 if norm_type is None else norm.part(norm_type))
        count = 0.0 if tokens is None else math.fsum(np.asarray(tokens.asnumpy(), np.float64).ravel())
        # [overflow flags, this pipeline's count (one writer), norm slots]: see the module docstring
        facts = np.concatenate([np.array([int(not finite)], np.int64), norm_slots(count, 0, 1)])
        if norm_type is not None:
            facts = np.concatenate([facts, norm.slots(part)])
        if self._pipeline is not None:
            values = ms.Tensor(facts)
            self._pipeline.all_reduce_sum([values])
            facts = values.asnumpy().copy()  # read through the tensor
        overflows, counts = int(facts[0]), facts[1:2]
        if self._replicas is not None:  # the replicas' norms are equal: only the two facts
            shared = ms.Tensor(
                np.concatenate(
                    [
                        facts[:1],
                        norm_slots(
                            float(counts.view(np.float64)[0]), self._replicas.rank, self._replicas.size
                        ),
                    ]
                )
            )
            self._replicas.all_reduce_sum([shared])
            summed = shared.asnumpy()
            overflows, counts = int(summed[0]), summed[1:]
        total = math.fsum(counts.view(np.float64))
        measured = None if norm_type is None else norm.combine(facts[2:], norm_type)
        return (overflows == 0 if self._checks_overflow else None), total, measured


def per_token_losses(results: Mapping[int, Any]) -> tuple[dict[int, Any], Any | None]:
    """``({micro: sum / count}, the counts)`` from the last stage's ``(sum, count)`` pairs
    (``({}, None)`` on other ranks); a count below 1 divides by 1. The counts come back
    stacked in their own dtype, to be added on the host in float64 (a float32 sum on the
    device rounds above 2**24)."""
    if not results:
        return {}, None
    import mindspore as ms
    from mindspore import ops

    losses, counts = {}, []
    for micro, (total, count) in results.items():
        counts.append(count)
        losses[micro] = total / ops.maximum(count.astype(ms.float32), 1.0).astype(total.dtype)
    return losses, ops.stack(counts)
