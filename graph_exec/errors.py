"""Exceptions shared by the layers (importable without MindSpore).

Every failure that crosses a rank boundary names the rank it happened on, and where known
the plan step and the peer, because a pipeline error is useless without "where".
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class GraphExecError(Exception):
    """Base class of every error this library raises on purpose."""


class CommunicationError(GraphExecError, RuntimeError):
    """The transport could not complete a message exchange."""


class CommunicationNotInitializedError(CommunicationError):
    """MindSpore communication was not initialised before the pipeline needed it."""


class PeerTimeoutError(CommunicationError, TimeoutError):
    """A blocking exchange did not complete in time: the peer is dead, stuck or out of step.

    The transport ends its message with :func:`silent_peers_note`, so that whoever reads the
    log of a waiting rank (the launcher's attempt record) learns which rank it waited for.
    """


_SILENT = re.compile(r"\[waiting for global ranks? ([\d, ]+)\]")


def silent_peers_note(ranks: Iterable[int]) -> str:
    """The words a :class:`PeerTimeoutError` ends with: the global ranks it waited for (one
    peer of a transfer; every other member of a collective)."""
    found = sorted(set(ranks))
    return f"[waiting for global rank{'s' if len(found) != 1 else ''} {', '.join(map(str, found))}]"


def silent_peers(text: str) -> frozenset[int]:
    """The global ranks a :func:`silent_peers_note` in ``text`` names (empty: none)."""
    match = _SILENT.search(text)
    return frozenset(int(r) for r in match.group(1).split(",")) if match else frozenset()


class RemoteRankError(CommunicationError):
    """A peer rank failed and told this rank so (best-effort abort notification)."""


class ProtocolError(CommunicationError):
    """A message arrived that the plan did not expect here (the ranks' plans disagree)."""


class StepTagMismatchError(ProtocolError):
    """A peer's transfer was stamped for another step than this rank's: the ranks disagree on
    what the step's data is (their tower placements differ; ``Transport.set_step_tag``)."""


class PipelineStepError(GraphExecError, RuntimeError):
    """A step of the plan failed; carries the rank, the step token and the peer (if any)."""

    def __init__(self, rank: int, step: str, peer: int | None, cause: BaseException) -> None:
        where = f"rank {rank}, step {step}" + (f", peer rank {peer}" if peer is not None else "")
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.rank = rank
        self.step = step
        self.peer = peer


class NonFiniteGradientError(GraphExecError, FloatingPointError):
    """A gradient held an infinity or a NaN and the caller asked for an error
    (``error_if_nonfinite=True``); raised on every rank of the mesh alike."""


class TiedCopiesDriftError(GraphExecError, ValueError):
    """The two copies of a tied pair no longer hold the same values (raised on every rank of the
    pipeline alike, at the end of the step that found it)."""


class ConfigurationMismatchError(GraphExecError, ValueError):
    """The ranks of one pipeline were set up differently (detected before any training message)."""
