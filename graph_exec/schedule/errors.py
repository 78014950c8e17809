"""What a broken plan raises.

Every plan is validated when it is built, so these mean a bug in a builder or a hand-written
plan that cannot run. Each message names the ranks and steps involved, because the only
alternative symptom is a multi-rank job that hangs without saying where.
"""

from __future__ import annotations

from graph_exec.errors import GraphExecError


class ScheduleError(GraphExecError):
    """A plan that breaks a rule of ``docs/schedule.md``, "Invariants"."""


class CoverageError(ScheduleError):
    """A forward or backward is missing, repeated, or on a rank that does not own its stage."""


class InvariantError(ScheduleError):
    """A layering rule is broken (body changed by MPipe, TBWD not after B 0.m, …)."""


class DependencyError(ScheduleError):
    """A step comes before the step that produces its input on the same rank."""


class PairingError(ScheduleError):
    """A send without its receive (or the reverse), per message type and rank pair."""


class FifoOrderError(ScheduleError):
    """Both ranks of a pair have the same messages, but in different orders."""


class DeadlockError(ScheduleError):
    """The blocking-rendezvous replay stops: ``stuck`` maps each waiting rank to its next step."""

    def __init__(self, message: str, stuck: dict[int, str]) -> None:
        super().__init__(message)
        self.stuck = stuck
