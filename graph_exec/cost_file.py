"""A model's measured costs, as a cost file holds them: what :mod:`graph_exec.tune` plans from
and :mod:`graph_exec.harness.model_costs` measures.

Its own module, below both: the planner is pure Python and reads cost files on any machine,
the harness runs MindSpore to fill one, and neither needs the other to know the format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any


class CostFileError(ValueError):
    """A cost file or :class:`ModelCosts` entry that is missing, unknown or out of range."""


@dataclass(frozen=True)
class ModelCosts:
    """What one micro-batch of ``micro_batch_size`` rows costs, per decoder layer and for the
    preprocess (times in any one unit, sizes in bytes)."""

    layers: int  #: decoder layers of the body, cut into ``P·V`` stages
    micro_batch_size: int  #: rows of the micro-batch the figures below were measured on
    layer_forward: float  #: one layer's forward
    layer_backward: float  #: one layer's backward (input and weight gradients)
    layer_activation_bytes: int  #: what one layer keeps for its backward (its tape)
    layer_param_bytes: int  #: one layer's parameters
    hidden_bytes: int  #: one stage boundary tensor (a stage's input, the gradient sent back)
    preprocess: str = "none"  #: ``"frozen"``, ``"trainable"`` or ``"none"``
    preprocess_forward: float = 0.0  #: the preprocess's forward
    preprocess_backward: float = 0.0  #: its backward from the tape (trainable only)
    #: MPipe's recompute-backward of the preprocess (trainable only): its forward and backward in
    #: one call, which a compiled graph can run for less than the two apart. ``None``: their sum.
    preprocess_recompute: float | None = None
    preprocess_output_bytes: int = 0  #: its output, shipped to rank 0
    preprocess_tape_bytes: int = 0  #: what its forward keeps for a taped backward
    preprocess_param_bytes: int = 0  #: its parameters (held on every rank that runs it)
    #: What stage 0 and the last stage do besides their layers (embedding; head and loss, whose
    #: forward and backward the last stage runs in one fused call), and the parameters they add.
    first_stage_forward: float = 0.0
    first_stage_backward: float = 0.0
    last_stage_forward: float = 0.0
    #: What any other stage's forward / backward call costs besides its layers (its dispatch,
    #: the send that follows): a stage of ``n`` layers costs ``chunk + n * layer``, so that a
    #: split into fewer, longer stages (a smaller ``V``) is priced by its calls, not only its
    #: layers. 0: the per-layer figures include it (one split cannot tell the two apart).
    chunk_forward: float = 0.0
    chunk_backward: float = 0.0
    first_stage_param_bytes: int = 0
    last_stage_param_bytes: int = 0
    #: What the last stage's fused step holds besides its layers' tapes (the head's logits and
    #: the loss's gradient of them: ``seq × vocab`` each), during that step.
    last_stage_activation_bytes: int = 0
    #: Share of every compute entry that does not grow with the rows (dispatch, kernel launch):
    #: a micro-batch of ``k`` times the rows costs ``fixed_share + (1 - fixed_share) * k`` times
    #: (where ``scale_points`` do not say better).
    fixed_share: float = 0.0
    #: Measured compute scales at other micro-batch sizes, ``((k, s), ...)``: a micro-batch of
    #: ``k`` times the rows costs ``s`` times. Per-row cost is rarely a straight line (caches,
    #: vector widths), so sizes between measured ones interpolate them; outside them
    #: ``fixed_share`` extrapolates.
    scale_points: tuple[tuple[float, float], ...] = ()
    #: The runtime's own time per compute step (the schedule's Python between kernels).
    op_overhead: float = 0.0
    #: Optimizer state per trained parameter byte (Adam: its two moments, 2.0; with bfloat16
    #: parameters Adam's float32 moments and the float32 master copy: (8 + 4) / 2 = 6.0).
    optimizer_bytes_per_param_byte: float = 2.0
    #: Gradient accumulator bytes per trained parameter byte (the schedules accumulate in
    #: float32: 1.0 for float32 parameters, 2.0 for bfloat16 or float16 ones).
    gradient_bytes_per_param_byte: float = 1.0
    latency: float = 0.0  #: per transfer
    bandwidth: float = math.inf  #: bytes per time unit

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "preprocess":
                if value not in ("frozen", "trainable", "none"):
                    raise CostFileError(f"preprocess must be 'frozen', 'trainable' or 'none', got {value!r}")
                continue
            if field.name == "preprocess_recompute" and value is None:
                continue
            if field.name == "scale_points":
                object.__setattr__(self, field.name, _scale_points(value))
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise CostFileError(f"cost entry {field.name!r} must be a number, got {value!r}")
            least = 1 if field.name in ("layers", "micro_batch_size") else 0
            if field.name == "fixed_share" and value > 1:
                raise CostFileError(f"cost entry 'fixed_share' must be in [0, 1], got {value!r}")
            if value < least or (math.isinf(value) and field.name != "bandwidth"):
                raise CostFileError(
                    f"cost entry {field.name!r} must be a finite number >= {least}, got {value!r}"
                )
        if not self.bandwidth > 0:
            raise CostFileError(f"cost entry 'bandwidth' must be > 0, got {self.bandwidth!r}")

    @classmethod
    def from_mapping(cls, entries: Mapping[str, Any]) -> ModelCosts:
        """From a cost file's JSON object: every required entry present, none unknown."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entries) - known)
        if unknown:
            raise CostFileError(f"unknown cost entries {unknown}; the entries are {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in entries]
        if missing:
            raise CostFileError(f"the cost file lacks {missing} (required: {required})")
        return cls(**entries)

    @classmethod
    def load(cls, path: str | Path) -> ModelCosts:
        """A cost file: one JSON object of this class's fields."""
        try:
            entries = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CostFileError(f"cannot read the cost file {path}: {exc}") from exc
        if not isinstance(entries, dict):
            raise CostFileError(
                f"the cost file {path} must hold one JSON object, got {type(entries).__name__}"
            )
        return cls.from_mapping(entries)


def _scale_points(value: Any) -> tuple[tuple[float, float], ...]:
    """``scale_points`` as a tuple of ``(k, s)`` pairs of positive numbers (a cost file has lists)."""
    try:
        points = tuple((float(k), float(s)) for k, s in value)
    except (TypeError, ValueError) as exc:
        raise CostFileError(f"cost entry 'scale_points' must be pairs [k, s], got {value!r}") from exc
    for k, s in points:
        if not (0 < k < math.inf and 0 < s < math.inf):
            raise CostFileError(f"cost entry 'scale_points' needs k > 0 and s > 0, got [{k!r}, {s!r}]")
    return points
