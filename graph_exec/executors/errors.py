"""Errors of the executor layer: all are ``GraphExecError``s and standard exceptions at once.

The runtime can catch every library failure as ``GraphExecError`` (and wrap it with its rank
and step), while plain Python code can keep catching ``ValueError``/``RuntimeError``/...
Each message names the hook, the stage and micro-batch where known, and the mismatch.
"""

from __future__ import annotations

from graph_exec.errors import GraphExecError


class ExecutorError(GraphExecError):
    """Base class of the errors below."""


class ExecutorConfigError(ExecutorError, ValueError):
    """The executor cannot be built as asked (unknown mode, duplicate parameter names, ...)."""


class HookOrderError(ExecutorError, RuntimeError):
    """A hook was called out of order: a backward without (or twice for) its forward, ..."""


class HookArgumentError(ExecutorError, ValueError):
    """A hook argument does not fit: cotangent count, shape or dtype, a non-scalar loss, ..."""


class HookTypeError(ExecutorError, TypeError):
    """A hook argument has the wrong type (a tensor was expected)."""


class UnknownStageError(ExecutorError, KeyError):
    """The stage is not one of this rank's stages."""

    def __str__(self) -> str:
        # KeyError quotes its argument; the message reads better without.
        return str(self.args[0]) if self.args else ""
