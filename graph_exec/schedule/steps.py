"""The step vocabulary of a pipeline plan.

A plan is one ordered list of steps per rank. Every step knows its kind and, where it has
them, the virtual stage and the micro-batch it belongs to. Tokens are spelled exactly as in
``docs/schedule.md`` (``F0.1``, ``Fsend0.1``, ``TFWD3``, ``GRADrecv+bwd2``) so that a plan
printed by the CLI can be compared with the examples there character by character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class StepKind(StrEnum):
    """Every kind of step a rank can run, spelled as in the plan's tokens.

    ``s`` is a virtual stage, ``m`` a micro-batch; "owner" is the rank that owns ``m``
    (``PlanConfig.owner``). What each step needs before it may run is in ``docs/schedule.md``,
    section "Step types"; what the runtime does for it, in ``docs/architecture.md``, "How a
    step flows".
    """

    #: Forward of stage ``s``, micro ``m``, on stage ``s``'s rank (the last stage adds loss and backward).
    F = "F"
    #: Backward of stage ``s``, micro ``m``, on stage ``s``'s rank: input grads out, weight grads accumulated.
    B = "B"
    #: Input half of a split backward (``body="zb"``): stage ``s``'s input gradient, which ``Bsend s.m``
    #: ships to stage ``s-1``; keeps the activations and output gradients ``W s.m`` needs.
    I = "I"  # noqa: E741 - the token's own spelling
    #: Weight half of a split backward (``body="zb"``): stage ``s``'s weight gradients, accumulated from
    #: the activations and output gradients ``I s.m`` kept; nobody waits for it.
    W = "W"
    #: Send ``F s.m``'s output from stage ``s``'s rank to stage ``s+1``'s rank.
    FSEND = "Fsend"
    #: Receive stage ``s``'s input from stage ``s-1``'s rank, on stage ``s``'s rank.
    FRECV = "Frecv"
    #: Send ``B s.m``'s input gradients from stage ``s``'s rank to stage ``s-1``'s rank.
    BSEND = "Bsend"
    #: Receive the gradient of stage ``s``'s output from stage ``s+1``'s rank, on stage ``s``'s rank.
    BRECV = "Brecv"
    #: Every rank (trainable preprocess, ``P > 1``): broadcast the preprocess weights from rank 0, in place.
    BCAST = "BCAST"
    #: Preprocess forward of ``m``, detached from the body, on the owner (rank 0 inline for ``run_ahead="min"``).
    TFWD = "TFWD"
    #: Owner to rank 0: ship ``m``'s preprocess output.
    OUTSEND = "OUTsend"
    #: Rank 0: receive ``m``'s preprocess output as stage 0's body input.
    OUTRECV = "OUTrecv"
    #: Owner to rank 0 (owned input, central backward): ship ``m``'s raw input so rank 0 can recompute.
    INSEND = "INsend"
    #: Rank 0: receive ``m``'s raw input, kept for ``TBWD m``.
    INRECV = "INrecv"
    #: Rank 0, right after ``B 0.m``: recompute ``m``'s preprocess and accumulate its parameter gradients.
    TBWD = "TBWD"
    #: Rank 0 to the owner (owner backward): ship the gradient of ``m``'s preprocess output.
    GRADSEND = "GRADsend"
    #: Owner (owner backward): receive that gradient, recompute ``m``'s preprocess, back-propagate locally.
    GRADRECV_BWD = "GRADrecv+bwd"
    #: Every rank, last step (owner backward): SUM all-reduce of the preprocess gradients over the pipeline.
    GRADREDUCE = "GRADreduce"
    #: An empty slot of the body's time grid: shown by ``with_idle`` only, never executed.
    IDLE = "·"


#: Body step kinds (compute and neighbour P2P, nothing MPipe adds), in the order their codes rely
#: on (:mod:`codes`: body kinds first, in this order).
BODY_ORDER = (
    StepKind.F,
    StepKind.B,
    StepKind.I,
    StepKind.W,
    StepKind.FSEND,
    StepKind.FRECV,
    StepKind.BSEND,
    StepKind.BRECV,
)
BODY_KINDS = frozenset(BODY_ORDER)
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
        """The token: ``F0.1``, ``TFWD3``, ``BCAST``, ``·``."""
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

        Raises ``ValueError`` naming the token when it is not a step token.
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
