"""How long a rank waits for its peers in a step: longer while a peer may be compiling.

``timeout_s`` bounds every wait for a peer, and a peer silent past it is named hung (the
restarter relaunches the job). But a healthy peer is silent while it compiles: the first
``run()`` compiles every kernel of its chunks, the first ``evaluate()`` the forward-only ones,
a step with shapes not run before compiles them anew, and the ``step()`` after such a run
compiles the optimizer's graph. Compiling a 7 B stage at ``jit_level="O1"`` on Ascend takes
minutes: with ``timeout_s`` alone the peers would name a healthy rank hung and the restarter
would loop.

So :class:`WaitBounds` gives every transport of the rank a bound per step, before the step's
first message: ``compile_timeout_s`` for a step that may compile (the first of its kind, a
``run()`` or an ``evaluate()``, with these micro-batch shapes and dtypes; and the ``step()``
that follows it), ``timeout_s`` otherwise. Every rank of a pipeline runs the same batch shapes
in a step, so every rank decides the same; a rank silent past the bound of its step is still
named hung. Which shapes were run is kept for the last :data:`KEPT_SIGNATURES` (least recently
used goes): a signature forgotten only makes a later step's bound the generous one.

The default ``compile_timeout_s`` (``None``) depends on the back end's own limit. On CPU
(either path) MindSpore fails every call at one limit per process (``MS_CPU_COMM_OP_TIMEOUT``,
:func:`~graph_exec.transport.cpu_workarounds.backend_limit_is_process_wide`), which the schedule
sets to the compile window: a longer window there makes every steady wait run on the
communication thread instead of the caller's (the fast path's direct calls), and a wait that
times out leaves its call in flight until that limit (seen to end the process with an abort at
exit). CPU compiles take seconds: the default there is ``timeout_s``, and a longer window is
opted into. Elsewhere the default is :data:`DEFAULT_COMPILE_TIMEOUT_S`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from graph_exec.runtime.microbatch import MicroBatches

#: The compile window where nothing else decides (accelerators): a large stage compiles in minutes.
DEFAULT_COMPILE_TIMEOUT_S = 1800.0
#: Step signatures remembered (kind and shapes of the micro-batches).
KEPT_SIGNATURES = 256


def compile_timeout(compile_timeout_s: float | None, timeout_s: float) -> float:
    """The bound of a step that may compile: the option, or its default (module docstring)."""
    if compile_timeout_s is not None:
        return compile_timeout_s
    from graph_exec.transport import backend_limit_is_process_wide

    return timeout_s if backend_limit_is_process_wide() else max(timeout_s, DEFAULT_COMPILE_TIMEOUT_S)


def step_signature(kind: str, batch: MicroBatches) -> tuple[Any, ...]:
    """What decides whether a step compiles: its kind and each micro-batch's shapes and dtypes."""

    def described(tensors: Sequence[Any]) -> tuple[Any, ...]:
        return tuple((tuple(t.shape), str(t.dtype)) for t in tensors)

    labels = batch.labels or ((),) * len(batch)
    return (
        kind,
        tuple(
            (described(inputs), tuple((k, *described((kw[k],))) for k in sorted(kw)), described(label))
            for inputs, kw, label in zip(batch.inputs, batch.kwargs, labels, strict=True)
        ),
    )


class WaitBounds:
    """Sets each step's bound on ``transports`` (those of this rank's groups, ``None`` skipped)."""

    def __init__(self, timeout_s: float, compile_timeout_s: float, transports: Sequence[Any | None]) -> None:
        self.timeout_s = timeout_s
        self.compile_timeout_s = compile_timeout_s
        self._transports = [t for t in transports if t is not None]
        self._seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()

    def before_step(self, kind: str, batch: MicroBatches) -> float:
        """Set and return the bound of a ``kind`` step (``"run"``, ``"evaluate"``) on ``batch``;
        it holds until the next step's (so for the ``step()`` after it too)."""
        signature = step_signature(kind, batch)
        may_compile = signature not in self._seen
        self._seen[signature] = None
        self._seen.move_to_end(signature)
        while len(self._seen) > KEPT_SIGNATURES:
            self._seen.popitem(last=False)
        bound = self.compile_timeout_s if may_compile else self.timeout_s
        for transport in self._transports:
            transport.set_wait_bound(bound)
        return bound
