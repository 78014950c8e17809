"""What happens to the gradients between the last plan step and the caller getting them back.

In order, after :class:`~graph_exec.runtime.driver.RankRuntime` has walked the plan:

1. **The step's facts, agreed by the mesh.** With a loss scaler every rank checks its own
   gradients (``mindspore.amp.all_finite``); with ``loss_reduction="token"`` the last stage's
   rank adds up its micro-batches' token counts. Both numbers travel in one two-element vector
   through one SUM all-reduce over the pipeline group and one over the data-parallel group
   (each rank's value is counted once: the pattern of
   :func:`~graph_exec.runtime.handshake.share_setup_outcome`), so every rank of the mesh sees
   the same overflow verdict and the same global token count.
2. **Data-parallel average** of every accumulator (:mod:`graph_exec.runtime.data_parallel`).
3. **Tied pairs** summed between the ranks holding them (:mod:`graph_exec.runtime.tied`).
4. **One factor in place:** ``1 / scale`` removes the loss scale; with per-token loss
   ``D / (scale · N)`` also turns the replicas' mean of token-loss *sums* into the gradient of
   ``Σ sums / N`` (``N``, the global token count, at least 1: a batch without tokens gives zero
   gradients). Applied even after an overflow (the values are not used then).
5. **Earlier gradients back.** Gradients accumulate across ``run()`` calls until
   ``zero_grad()``, but steps 1-4 must see only this step's: when the accumulators held
   earlier gradients, :meth:`StepEnd.begin` set them aside (a copy, then zeros) and they are
   added back here, untouched by this step's factor whatever it is. (Multiplying the earlier
   gradients by the scale before the step and unscaling everything after would be exact only
   for a power-of-two scale, and cannot express the per-token factor, known only after the
   step.) The factor itself is one float32 multiplication: exact for a power-of-two scale (a
   ``DynamicLossScaler`` started at one stays one) and within a rounding of ``1/scale``
   otherwise (``StaticLossScaler(1000)``, tested).
6. **The scaler adjusted** with the agreed verdict, identically on every rank.

Nothing here runs for a schedule without scaler, per-token loss or tied pairs beyond the
data-parallel average it always did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graph_exec.runtime.data_parallel import DataParallelGrads
from graph_exec.runtime.loss_scaling import LossScale
from graph_exec.runtime.tied import TiedGradients


class StepEnd:
    """The end of every step on one rank (see the module docstring).

    ``groups``: the transports of this rank's pipeline and data-parallel groups, where they
    exist (``None`` entries skipped); ``dp_size``: the number of replicas.
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
    ) -> None:
        self.executor = executor
        self._groups = [group for group in groups if group is not None]
        self._dp_size = dp_size
        self.loss_scale = loss_scale
        self._token_loss = token_loss
        self._data_parallel = data_parallel
        self._tied = tied
        self._checks_overflow = loss_scale.scaler is not None
        #: Whether this step's gradients must be post-processed on their own (step 4, step 3).
        self.own_gradients = self._checks_overflow or token_loss or tied is not None
        self._set_aside = False

    def begin(self, accumulated: bool) -> None:
        """Before the plan runs: give the last stage this step's loss scale, and set earlier
        gradients aside when ``accumulated`` (the accumulators are not zero) and they must be."""
        if self._checks_overflow:
            self.executor.set_loss_scale(self.loss_scale.for_graph())
        self._set_aside = accumulated and self.own_gradients
        if self._set_aside:
            self.executor.set_aside_grads()

    def finish(self, results: Mapping[int, Any]) -> tuple[dict[int, Any], bool | None]:
        """After the plan ran: steps 1-6 of the module docstring. Returns the per-micro-batch
        losses (``sum / count`` for per-token loss) and the mesh's overflow verdict (``True``:
        every gradient finite; ``None`` without a loss scaler: nothing was checked)."""
        losses, tokens = per_token_losses(results) if self._token_loss else (dict(results), None)
        finite, total_tokens = (
            self._agree(tokens) if self._checks_overflow or self._token_loss else (None, 0.0)
        )
        if self._data_parallel is not None:
            self._data_parallel.average()
        if self._tied is not None:
            self._tied.sum_gradients()
        factor = 1.0
        if self._checks_overflow:
            factor /= self.loss_scale.value()
        if self._token_loss:
            factor *= self._dp_size / max(total_tokens, 1.0)
        if factor != 1.0:
            self.executor.scale_grads(factor)
        if self._set_aside:
            self.executor.add_back_grads()
            self._set_aside = False
        if finite is not None:
            self.loss_scale.adjust(finite)
        return losses, finite

    def abandon(self) -> None:
        """A step failed: nothing is added back (the schedule refuses further steps anyway)."""
        self._set_aside = False

    def _agree(self, tokens: Any | None) -> tuple[bool | None, float]:
        """Step 1: ``(every gradient finite over the mesh, global token count)``."""
        import mindspore as ms
        import numpy as np

        overflowed = self._checks_overflow and not self.executor.grads_all_finite()
        count = 0.0 if tokens is None else float(tokens.asnumpy())
        facts = ms.Tensor(np.array([float(overflowed), count], np.float32))
        for group in self._groups:
            group.all_reduce_sum([facts])
        overflows, total = (float(value) for value in facts.asnumpy())  # read through the tensor
        return (overflows == 0.0 if self._checks_overflow else None), total


def per_token_losses(results: Mapping[int, Any]) -> tuple[dict[int, Any], Any | None]:
    """``({micro: sum / count}, Σ counts)`` from the last stage's ``(sum, count)`` pairs
    (``({}, None)`` on other ranks); a count below 1 divides by 1."""
    if not results:
        return {}, None
    import mindspore as ms
    from mindspore import ops

    losses, counts = {}, []
    for micro, (total, count) in results.items():
        count = count.astype(ms.float32)
        counts.append(count)
        losses[micro] = total / ops.maximum(count, 1.0).astype(total.dtype)
    return losses, ops.stack(counts).sum()
