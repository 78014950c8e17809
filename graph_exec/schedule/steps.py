"""The step vocabulary of a pipeline plan.

A plan is one ordered list of steps per rank. Every step knows its kind and, where it has
them, the virtual stage and the micro-batch it belongs to. Tokens are spelled exactly as in
the MPipe schedule contract (``F0.1``, ``Fsend0.1``, ``TFWD3``, ``GRADrecv+bwd2``) so that a
plan printed by the CLI can be compared with the contract's examples character by character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class StepKind(StrEnum):
    """Every kind of step a rank can run (``IDLE`` only appears in pictures)."""

    F = "F"
    B = "B"
    FSEND = "Fsend"
    FRECV = "Frecv"
    BSEND = "Bsend"
    BRECV = "Brecv"
    BCAST = "BCAST"
    TFWD = "TFWD"
    OUTSEND = "OUTsend"
    OUTRECV = "OUTrecv"
    INSEND = "INsend"
    INRECV = "INrecv"
    TBWD = "TBWD"
    GRADSEND = "GRADsend"
    GRADRECV_BWD = "GRADrecv+bwd"
    GRADREDUCE = "GRADreduce"
    IDLE = "·"


#: Body step kinds: the unchanged interleaved-1F1B part of a plan.
BODY_KINDS = frozenset(
    {StepKind.F, StepKind.B, StepKind.FSEND, StepKind.FRECV, StepKind.BSEND, StepKind.BRECV}
)
#: Step kinds that carry a virtual stage index.
STAGED_KINDS = BODY_KINDS
#: Step kinds that carry neither a stage nor a micro-batch.
GLOBAL_KINDS = frozenset({StepKind.BCAST, StepKind.GRADREDUCE, StepKind.IDLE})
#: MPipe step kinds layered on top of the body.
MPIPE_KINDS = frozenset(StepKind) - BODY_KINDS - {StepKind.IDLE}
#: Step kinds that send a message to a peer rank, and those that receive one.
SEND_KINDS = frozenset({StepKind.FSEND, StepKind.BSEND, StepKind.OUTSEND, StepKind.INSEND, StepKind.GRADSEND})
RECV_KINDS = frozenset(
    {StepKind.FRECV, StepKind.BRECV, StepKind.OUTRECV, StepKind.INRECV, StepKind.GRADRECV_BWD}
)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of one rank's order.

    ``stage`` is set for body kinds only, ``micro`` for every kind except the global ones.
    """

    kind: StepKind
    stage: int | None = None
    micro: int | None = None

    def __post_init__(self) -> None:
        needs_stage = self.kind in STAGED_KINDS
        needs_micro = self.kind not in GLOBAL_KINDS
        if needs_stage != (self.stage is not None) or needs_micro != (self.micro is not None):
            raise ValueError(
                f"step {self.kind.value!r} takes "
                f"{'a stage and ' if needs_stage else ''}{'a micro index' if needs_micro else 'no index'}"
                f", got stage={self.stage!r} micro={self.micro!r}"
            )

    @property
    def token(self) -> str:
        """The contract's spelling: ``F0.1``, ``TFWD3``, ``BCAST``, ``·``."""
        if self.stage is not None:
            return f"{self.kind.value}{self.stage}.{self.micro}"
        if self.micro is not None:
            return f"{self.kind.value}{self.micro}"
        return self.kind.value

    def __str__(self) -> str:
        return self.token

    @classmethod
    def parse(cls, token: str) -> Step:
        """The inverse of :attr:`token`, so plans can be written by hand (tests, JSON files).

        Raises ``ValueError`` naming the token when it is not a step of the contract.
        """
        match = _TOKEN_RE.fullmatch(token.strip())
        if match is None:
            raise ValueError(f"not a step token: {token!r} (expected e.g. 'F0.1', 'TFWD3', 'BCAST', '·')")
        kind, stage, micro = match.groups()
        try:
            return cls(
                StepKind(kind),
                None if stage is None else int(stage),
                None if micro is None else int(micro),
            )
        except ValueError as err:
            raise ValueError(f"not a step token: {token!r}: {err}") from None


# Longest spellings first so that ``Fsend`` is never read as ``F`` followed by garbage.
_TOKEN_RE = re.compile(
    "("
    + "|".join(re.escape(k.value) for k in sorted(StepKind, key=lambda k: -len(k.value)))
    + r")(?:(\d+)\.)?(\d+)?"
)

IDLE = Step(StepKind.IDLE)
