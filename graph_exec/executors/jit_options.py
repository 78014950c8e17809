"""The one place the library calls ``mindspore.jit``, and the compiler options a user may pass it.

Every compiled kernel (stage chunks, the preprocess, the fused last stage, the whole-gradient
kernels of :mod:`graph_exec.kernels.grad_ops`, the dynamic-shape graphs, the loss scaler's
``adjust``) is made by :func:`compile_function`, with the schedule's ``jit_options``. Without
options it is exactly ``mindspore.jit(function)``: MindSpore's defaults (``jit_level="O0"``,
the ``ms_backend`` back end).

The accepted options are those of ``mindspore.jit`` in MindSpore 2.10 that change how a graph
is optimised or run, checked here so that a bad key or value fails at construction, naming
itself, instead of inside the first compile on some rank (2.10 only logs a warning for an
option it does not know). ``capture_mode`` and ``dynamic`` are the library's to choose and are
refused: ``"trace"`` capture returns stale gradients (``docs/shapes.md`` and the design notes),
and dynamic shapes are asked for with ``shapes="dynamic"``. ``docs/api.md`` says what the
levels mean on Ascend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

#: Each accepted option, with the values ``mindspore.jit`` accepts for it (2.10).
JIT_OPTIONS: dict[str, tuple[Any, ...]] = {
    # jit's own keywords
    "jit_level": ("O0", "O1"),
    "backend": ("", "ms_backend", "GE"),
    "fullgraph": (False, True),
    # jit's **options for the ms_backend
    "exec_order": ("bfs", "dfs"),
    "disable_format_transform": (False, True),
}

#: Keywords of ``mindspore.jit`` the library sets itself, and why.
_REFUSED = {
    "capture_mode": "the library compiles with the default 'ast' capture ('trace' returns stale gradients)",
    "dynamic": "dynamic-shape compilation is chosen with the schedule option shapes='dynamic'",
}


def check_jit_options(options: Any, error: type[Exception] = ValueError) -> dict[str, Any]:
    """``options`` as a plain dict when every key and value is one ``mindspore.jit`` accepts
    (``None``: no options); otherwise ``error`` naming the bad key or value and what is allowed."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise error(
            f"jit_options must be a dict of mindspore.jit options or None, got {type(options).__name__}: "
            "e.g. jit_options={'jit_level': 'O1'}"
        )
    checked = {}
    for key, value in options.items():
        if key in _REFUSED:
            raise error(f"jit_options: {key!r} cannot be set: {_REFUSED[key]}")
        if key not in JIT_OPTIONS:
            raise error(f"jit_options: unknown option {key!r}; allowed: {', '.join(map(repr, JIT_OPTIONS))}")
        allowed = JIT_OPTIONS[key]
        # bool is an int: compare type as well, so that fullgraph=1 is not taken for True.
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise error(f"jit_options[{key!r}] must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        checked[key] = value
    return checked


def compile_function(function: Callable[..., Any], options: Mapping[str, Any]) -> Callable[..., Any]:
    """``mindspore.jit(function, **options)``: how every kernel of the library is compiled."""
    import mindspore as ms

    return ms.jit(function, **options)
