"""Loss scaling with MindSpore's own scalers, and the loss scale the last stage differentiates.

The schedules take a ``mindspore.amp.DynamicLossScaler`` or ``StaticLossScaler`` as they are:
the scaler keeps its scale (``scale_value``, a ``Parameter``) and decides how it moves
(``adjust``); the schedule only reads the scale before a step (once: the same number is removed
after it), hands it to the last stage's graph as an input (so a new scale compiles nothing),
unscales the gradients after the step and
calls ``adjust`` with the verdict every rank of the mesh agreed on
(:mod:`graph_exec.runtime.step_end`). The scaler's own ``scale``/``unscale`` are not used: the
scale is applied inside the last stage's graph and removed from the accumulators in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What ``loss_scaler=`` accepts, for error messages.
ACCEPTED = "mindspore.amp.DynamicLossScaler or mindspore.amp.StaticLossScaler (or None)"


def check_loss_scaler(scaler: Any) -> Any:
    """``scaler`` if it is one of MindSpore's loss scalers (or ``None``); a clear error else.

    Any ``mindspore.amp.LossScaler`` with a ``scale_value`` parameter works the same way; the
    loss-scale *managers* (``DynamicLossScaleManager``, ``FixedLossScaleManager``) belong to
    ``mindspore.train.Model`` and are refused with a pointer to the scaler to use instead.
    """
    if scaler is None:
        return None
    from mindspore import Parameter, amp

    name = type(scaler).__name__
    if isinstance(scaler, amp.LossScaleManager):
        replacement = "DynamicLossScaler" if "Dynamic" in name else "StaticLossScaler"
        raise TypeError(
            f"loss_scaler must be {ACCEPTED}, got the manager {name} (managers drive mindspore.train.Model): "
            f"pass mindspore.amp.{replacement}(...) instead"
        )
    if not isinstance(scaler, amp.LossScaler) or not isinstance(
        getattr(scaler, "scale_value", None), Parameter
    ):
        raise TypeError(f"loss_scaler must be {ACCEPTED}, got {name}")
    return scaler


def describe_loss_scaler(scaler: Any) -> str:
    """What every rank's scaler must share (compared at set-up): its kind and settings."""
    if scaler is None:
        return "none"
    settings = {k: getattr(scaler, k) for k in ("scale_factor", "scale_window") if hasattr(scaler, k)}
    value = float(scaler.scale_value.asnumpy())
    return f"{type(scaler).__name__}(scale_value={value!r}, {settings})"


class LossScale:
    """The scale of one schedule's loss: ``base`` (``1/M`` with ``scale_grads``, else 1) times
    the scaler's current value (1 without a scaler).

    ``compiled``: call the scaler's ``adjust`` as one compiled graph (graph mode: 0.4 against
    3.0 ms for the ten-odd eager ops of ``DynamicLossScaler.adjust``, measured here), else eagerly;
    ``jit_options``: what that compile is given (the schedule's).
    """

    def __init__(
        self, scaler: Any, base: float, compiled: bool = False, jit_options: Mapping[str, Any] | None = None
    ) -> None:
        self.scaler = scaler
        self.base = float(base)
        self._adjust = None if scaler is None else scaler.adjust
        if scaler is not None and compiled:
            from graph_exec.executors.jit_options import compile_function

            def adjust(finite: Any) -> Any:
                return scaler.adjust(finite)

            self._adjust = compile_function(adjust, jit_options or {})

    def value(self) -> float | None:
        """The scaler's current value (read back), ``None`` without a scaler."""
        return None if self.scaler is None else float(self.scaler.scale_value.asnumpy())

    def adjust(self, finite: bool) -> None:
        """Let the scaler move its scale for this verdict (``StaticLossScaler`` keeps it)."""
        if self._adjust is not None:
            from mindspore import Tensor

            self._adjust(Tensor(bool(finite)))
