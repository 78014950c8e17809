"""Whether this step's gradients may change the weights: one verdict for the whole mesh.

Between ``run()`` and the optimizer, :meth:`ScheduleMPipeTranspose.step` and
:meth:`~ScheduleMPipeTranspose.clip_grad_norm` must decide the same thing on every rank, or the
mesh splits: one rank applies a NaN update while the others skip it, or one rank raises (an
optimizer over parameters it does not train) and the others wait for it until msrun kills them
with an empty log. So the ranks meet once, in one small vector (int64, one SUM all-reduce over
the pipeline group, the flags once more over the data-parallel group, each rank counted once:
the pattern of :func:`~graph_exec.runtime.handshake.share_setup_outcome`):

- one **failure flag** per rank of the mesh: a rank whose checks (the optimizer's parameters)
  or whose share of the norm raised says so; the failing rank re-raises its own error, every
  other rank raises :class:`~graph_exec.errors.RemoteRankError` naming it. The ranks are still
  in step (nothing was applied): the schedule stays usable;
- how many ranks found a **non-finite gradient** (without a loss scaler and without clipping:
  one pass over the accumulators, the scaler's unscale-and-check with the factor 1);
- the **norm** shares, when the norm is measured (:mod:`graph_exec.runtime.grad_norm`): a
  non-finite norm is a non-finite gradient, seen alike by every rank.

When do the ranks meet? Only when something must be learnt from the others, so that the
steady training loop costs nothing more than before:

- the norm is to be measured (clipping, and the step's end did not measure it along);
- no loss scaler and no clipping: the finiteness check needs the mesh;
- ``step()`` sees an optimizer for the first time (by identity; it is held): a bad one fails
  alone on one rank, so its check must be shared once. Its parameters never change, so the
  same optimizer cannot fail the check later.

With a loss scaler the verdict came with ``run()``'s own meeting (:mod:`.step_end`), and with
the norm along it too from the second clipped step on: then nothing is exchanged here.

**By default a non-finite gradient is refused**: the update is skipped on every rank (``step()``
reports ``finite: False`` and still zeroes the gradients, as for a loss scaler's overflow),
:class:`~graph_exec.runtime.grad_norm.NonFiniteGradientWarning` is issued once per refused
call on every rank (not for a loss scaler's overflow: skipping is the scaler's ordinary work),
and ``clip_grad_norm()`` returns the norm and scales nothing. ``error_if_nonfinite=True``
raises :class:`~graph_exec.errors.NonFiniteGradientError` on every rank instead (torch's
``clip_grad_norm_(error_if_nonfinite=True)``), leaving the gradients as they are.

An error after the verdict (the optimizer itself raising on one rank) cannot be shared this
way: that rank aborts its transport (its peers' next receive from it names the reason) and the
schedule refuses further steps, as after a failed ``run()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from graph_exec.errors import NonFiniteGradientError, RemoteRankError
from graph_exec.runtime.grad_norm import GlobalGradNorm, warn_non_finite

#: The norm type of ``step(max_norm=...)`` (``clip_grad_norm`` takes any).
STEP_NORM_TYPE = 2.0


@dataclass(frozen=True)
class Verdict:
    """What the mesh agreed: the step may go on (``finite``), with the mesh's norm or ``None``."""

    finite: bool
    norm: float | None


class UpdateGate:
    """One rank's side of the verdict (see the module docstring).

    ``groups``: the transports of this rank's pipeline and data-parallel groups (``None`` where
    the group has one rank); ``checks_overflow``: whether a loss scaler gives the verdict.
    """

    def __init__(
        self,
        executor: Any,
        groups: tuple[Any | None, Any | None],
        grad_norm: GlobalGradNorm,
        checks_overflow: bool,
    ) -> None:
        self.executor = executor
        self._pipeline, self._replicas = groups
        self._grad_norm = grad_norm
        self._checks_overflow = checks_overflow
        present = [g for g in groups if g is not None]
        self._world = int(np.prod([g.size for g in present])) if present else 1
        self._me = present[0].ranks[present[0].rank] if present else 0
        self._optimizer: Any = None  #: the last optimizer whose check every rank passed
        self._agreed = False  # whether the failure being raised was raised by every rank alike
        #: How many all-reduces this rank's verdicts ran (the tests count them).
        self.meetings = 0
        #: How many calls refused a non-finite gradient with a warning.
        self.refusals = 0

    # -- the two calls ------------------------------------------------------------------------

    def before_update(
        self,
        optimizer: Any,
        problem: BaseException | None,
        scaler_finite: bool | None,
        max_norm: float | None,
        error_if_nonfinite: bool,
    ) -> Verdict:
        """For ``step()``: the mesh's verdict on this step's gradients, the optimizer's check
        (``problem``: what it raised here, or ``None``) included. Clips when the gradients
        are finite and ``max_norm`` is given; raises as the module docstring says."""
        self._agreed = False
        norm_type = STEP_NORM_TYPE if max_norm is not None and scaler_finite is not False else None
        known = None if norm_type is None else self._grad_norm.known(norm_type)
        check_finite = scaler_finite is None and norm_type is None
        measure = norm_type is not None and known is None
        if measure or check_finite or optimizer is not self._optimizer:
            nonfinite, norm = self._meet("step()", problem, check_finite, norm_type if measure else None)
        elif problem is not None:  # cannot happen: this optimizer passed on every rank before
            raise problem
        else:
            nonfinite, norm = False, None
        norm = known if known is not None else norm
        self._optimizer = optimizer
        finite = scaler_finite is not False and not nonfinite and (norm is None or math.isfinite(norm))
        if not finite and (scaler_finite is None or norm is not None):
            self._refuse("step()", norm, error_if_nonfinite, "the optimizer was not applied")
        if finite and max_norm is not None:
            self._grad_norm.clip(norm, max_norm, norm_type)
        return Verdict(finite, norm if finite else None)

    def clip(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> float:
        """For ``clip_grad_norm()``: the mesh's ``norm_type``-norm (measured, or the one the
        step's end measured), the gradients scaled by it when it is finite."""
        self._agreed = False
        norm = self._grad_norm.known(norm_type)
        if norm is None:
            _, norm = self._meet("clip_grad_norm()", None, False, norm_type)
        self._grad_norm.clip(norm, max_norm, norm_type)  # scales nothing for a non-finite norm
        if not math.isfinite(norm):
            self._refuse("clip_grad_norm()", norm, error_if_nonfinite, "nothing was scaled")
        return norm

    # -- the meeting --------------------------------------------------------------------------

    def _meet(
        self, what: str, problem: BaseException | None, check_finite: bool, norm_type: float | None
    ) -> tuple[bool, float | None]:
        """One exchange: ``(some rank found a non-finite gradient, the norm or None)``, after
        raising on every rank if any failed (its own error on the failing rank)."""
        nonfinite, part = False, 0.0
        if problem is None:
            try:
                if check_finite:
                    nonfinite = not self.executor.unscale_and_check(1.0, (), None)[0]
                if norm_type is not None:
                    part = self._grad_norm.part(norm_type)
            except Exception as exc:  # shared like a bad optimizer: the others must hear of it
                problem = exc
        flags = np.zeros(self._world + 1, np.int64)
        flags[self._me] = int(problem is not None)
        flags[-1] = int(nonfinite)
        slots = self._grad_norm.slots(part) if norm_type is not None else np.zeros(0, np.int64)
        summed = self._exchange(flags, slots)
        failed = [rank for rank in range(self._world) if summed[rank]]
        self._agreed = bool(failed)
        if problem is not None:
            raise problem
        if failed:
            raise RemoteRankError(
                f"ranks {failed} failed in {what} (their logs give the reason); rank {self._me} "
                "stops too: no rank changed its gradients or weights"
            )
        norm = None if norm_type is None else self._grad_norm.combine(summed[len(flags) :], norm_type)
        return bool(summed[self._world]), norm

    def _exchange(self, flags: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``flags`` summed over the mesh, ``slots`` over the pipeline (the replicas' norms
        are equal: not added again)."""
        import mindspore as ms

        vector = np.concatenate([flags, slots])
        if self._pipeline is not None:
            tensor = ms.Tensor(vector)
            self._pipeline.all_reduce_sum([tensor])
            self.meetings += 1
            vector = tensor.asnumpy().copy()  # read through the tensor
        if self._replicas is not None:
            shared = ms.Tensor(vector[: len(flags)].copy())
            self._replicas.all_reduce_sum([shared])
            self.meetings += 1
            vector[: len(flags)] = shared.asnumpy()
        return vector

    def after_failure(self, exc: BaseException) -> str | None:
        """After ``exc`` escaped :meth:`before_update`, :meth:`clip` or the optimizer: ``None``
        when every rank raised alike (still in step), else the reason the schedule records to
        refuse further steps, once the peers were told (best effort: their next receive from
        this rank names it)."""
        if self._agreed:
            return None
        reason = f"{type(exc).__name__}: {exc}"
        for group in (self._pipeline, self._replicas):
            if group is not None:
                group.abort(f"after its step: {reason}")
        return reason

    def _refuse(self, what: str, norm: float | None, error_if_nonfinite: bool, outcome: str) -> None:
        """Every rank: raise with ``error_if_nonfinite``, else warn once for this call."""
        found = "a gradient is not finite" if norm is None else f"the global gradient norm is {norm}"
        if error_if_nonfinite:
            self._agreed = True
            raise NonFiniteGradientError(
                f"{what}: {found} (error_if_nonfinite=True); the gradients are left as they are"
            )
        self.refusals += 1  # in the message: Python's default filter shows a repeated one once only
        warn_non_finite(
            f"{what}: {found} on some rank of the mesh; {outcome} on any rank "
            f"(non-finite step {self.refusals} of this schedule)"
        )
