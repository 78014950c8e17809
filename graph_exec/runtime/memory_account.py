"""What a rank holds, measured: the library's own accounting of the tensors it keeps.

The schedule's memory model (:mod:`graph_exec.schedule.memory`) predicts, from the plan, which
items each rank holds at each step. This module measures the same kinds from the tensors the
runtime and the executor really hold, so prediction and measurement can be compared kind by
kind:

- ``activations`` of stage ``s``: each forward the executor keeps for its backward — its input
  tensors (all it keeps with ``recompute=True``) and, for a forward recorded under the tape, its
  outputs. What MindSpore's tape keeps inside the recorded graph is MindSpore's and is not
  visible without reading the device, so a taped forward is counted by the tensors at its
  boundary (a lower bound; the allocator peak and the peak RSS see the rest). The last stage's
  fused forward-and-backward keeps nothing between steps: its input is counted during that step;
- ``receive slots``: the bytes of every received message whose buffer is still out (a whole
  frame: prefix, aligned tensors, at least a control message's size);
- ``preprocess outputs``: a preprocess forward's outputs until they are shipped (an owner) or
  read by ``F 0.m`` (rank 0);
- ``preprocess tapes``: taped preprocess forwards (``keep_preprocess_tape``, the fair
  baseline's trainable preprocess), counted as stage forwards are;
- ``held weight gradients``: what a split backward's ``I`` keeps for its ``W``.

Everything is read from shapes (``nbytes``): no device synchronisation, a few microseconds a
step. The account is observed once per plan step, after the step and before its receive
buffers are given back: like the model, an item counts from the step that makes it through
the step that last reads it (a step allocates before it releases).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from functools import cache
from math import prod
from typing import Any

#: The kinds observed at every step, in the order they are reported.
STEP_KINDS = (
    "activations",
    "receive_slots",
    "preprocess_outputs",
    "preprocess_tapes",
    "held_weight_gradients",
)
#: The kinds held by key (the receive slots are read as one total from the receive buffers).
_KEYED = tuple(kind for kind in STEP_KINDS if kind != "receive_slots")


@cache
def _itemsize(dtype: Any) -> int:
    import mindspore as ms
    import numpy as np

    return int(np.dtype(ms.dtype_to_nptype(dtype)).itemsize)


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor (a MindSpore tensor, a numpy array, or anything with ``shape`` and
    ``dtype``, such as an executor's ``TensorSpec``), from its shape; ``None`` counts 0."""
    if tensor is None:
        return 0
    nbytes = getattr(tensor, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return prod(int(d) for d in tensor.shape) * _itemsize(tensor.dtype)


def tensors_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of every tensor of ``tensors`` (nested tuples and lists flattened)."""
    total = 0
    for tensor in tensors:
        total += tensors_bytes(tensor) if isinstance(tensor, tuple | list) else tensor_bytes(tensor)
    return total


def held_bytes(value: Any) -> int:
    """Bytes of what a split backward's ``I`` holds for its ``W``: a tuple of weight gradients,
    or an object that says its own ``nbytes`` (the saved inputs and output gradients)."""
    return tensors_bytes(value) if isinstance(value, tuple | list) else tensor_bytes(value)


def kept_forward_bytes(kept: Any) -> int:
    """What a kept forward holds that the library can see: its inputs, and its outputs when it
    was recorded under the tape (``kept.outputs`` are their shapes)."""
    return tensors_bytes(kept.args) + (tensors_bytes(kept.outputs) if kept.recorded else 0)


def parameter_bytes(cells: Iterable[Any]) -> int:
    """Bytes of every parameter of ``cells``, each parameter once (by identity)."""
    unique = {id(p): p for cell in cells for p in cell.get_parameters()}
    return sum(tensor_bytes(p) for p in unique.values())


def optimizer_state_bytes(optimizer: Any, trained: Iterable[Any]) -> int:
    """Bytes of ``optimizer``'s own parameters (moments, step counters, learning rate): every
    parameter of the optimizer cell that is not one of the ``trained`` ones."""
    model = {id(p) for p in trained}
    own = {id(p): p for p in optimizer.get_parameters() if id(p) not in model}
    return sum(tensor_bytes(p) for p in own.values())


class _Kind:
    """The held items of one kind: bytes by key, their running total and its peak."""

    __slots__ = ("gone", "items", "peak", "total")

    def __init__(self) -> None:
        self.items: dict[Hashable, int] = {}
        self.gone: set[Hashable] = set()  # released during the current step: counted through it
        self.total = 0
        self.peak = 0

    def hold(self, key: Hashable, nbytes: int) -> None:
        self.total += nbytes - self.items.get(key, 0)
        self.items[key] = nbytes

    def release_after_step(self, key: Hashable) -> None:
        if key in self.items:
            self.gone.add(key)

    def end_step(self) -> int:
        """The bytes held during the step just ended; then forget what it released."""
        held = self.total
        self.peak = max(self.peak, held)
        for key in self.gone:
            self.total -= self.items.pop(key, 0)
        self.gone.clear()
        return held


class MemoryAccount:
    """Peak bytes per kind over one training step of one rank (reset by :meth:`begin_step`).

    The driver tells it what it holds (:meth:`hold`, :meth:`release_after_step`) and hands it
    the executor's kept state at each step (:meth:`observe`); per-stage peaks and the size of
    one micro-batch's activations per stage are kept for the memory model's calibration.
    """

    def __init__(self) -> None:
        self.begin_step()

    def begin_step(self) -> None:
        self._kinds = {kind: _Kind() for kind in _KEYED}
        self._stage_now: dict[int, int] = {}
        self.stage_peaks: dict[int, int] = {}
        self.per_micro: dict[int, int] = {}
        self.held_by_step: list[int] = []  # one entry per plan step: bounded by the plan
        self._receive_peak = 0

    def hold(self, kind: str, key: Hashable, tensors: Iterable[Any]) -> None:
        """``kind`` holds ``tensors`` under ``key`` from this step on (activations: key ``(stage, micro)``)."""
        nbytes = tensors_bytes(tensors)
        if kind == "activations":
            self._hold_activation(key, nbytes)
        else:
            self._kinds[kind].hold(key, nbytes)

    def release_after_step(self, kind: str, key: Hashable) -> None:
        """``kind`` gives ``key`` back once the current step is observed."""
        self._kinds[kind].release_after_step(key)

    def _hold_activation(self, key: Hashable, nbytes: int) -> None:
        stage = key[0]
        if key not in self._kinds["activations"].items:
            self._stage_now[stage] = self._stage_now.get(stage, 0) + nbytes
        self._kinds["activations"].hold(key, nbytes)
        self.per_micro[stage] = max(self.per_micro.get(stage, 0), nbytes)

    def sync(self, kind: str, held: Mapping[Hashable, Any], size: Any = kept_forward_bytes) -> None:
        """Make ``kind`` what ``held`` (key to a kept object, ``size`` its bytes) holds now: a
        new key is held from this step, a missing one released after it."""
        items = self._kinds[kind].items
        for key, value in held.items():
            if key not in items:
                if kind == "activations":
                    self._hold_activation(key, size(value))
                else:
                    self._kinds[kind].hold(key, size(value))
        for key in items:
            if key not in held:
                self.release_after_step(kind, key)

    def observe(self, receive_bytes: int) -> None:
        """The end of one plan step: fold what is held now (and ``receive_bytes`` of receive
        buffers still out) into the peaks, then forget what the step released."""
        acts = self._kinds["activations"]
        for stage, now in self._stage_now.items():
            if now > self.stage_peaks.get(stage, 0):
                self.stage_peaks[stage] = now
        for key in acts.gone:
            self._stage_now[key[0]] -= acts.items.get(key, 0)
        self._receive_peak = max(self._receive_peak, receive_bytes)
        held = receive_bytes + sum(kind.end_step() for kind in self._kinds.values())
        self.held_by_step.append(held)

    @property
    def held_peak(self) -> int:
        """The most bytes held at once, every kind together, over the plan steps observed since
        :meth:`begin_step`."""
        return max(self.held_by_step, default=0)

    def peaks(self) -> dict[str, Any]:
        """The step's peaks in bytes: one per kind, per stage for the activations, the size of
        one micro-batch's activations per stage, and the peak of all kinds held at once."""
        out: dict[str, Any] = {
            kind: self._receive_peak if kind == "receive_slots" else self._kinds[kind].peak
            for kind in STEP_KINDS
        }
        out["activations_per_stage"] = dict(sorted(self.stage_peaks.items()))
        out["activation_bytes_per_micro"] = dict(sorted(self.per_micro.items()))
        out["held_peak"] = self.held_peak
        return out
