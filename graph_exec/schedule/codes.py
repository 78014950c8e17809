"""Steps as plain integers, for the hot paths (``docs/schedule.md``, "Step codes").

A plan for 64 ranks, 4 chunks and 1024 micro-batches has about 1.6 million steps. Making a
:class:`~graph_exec.schedule.steps.Step` object costs close to a microsecond here, so building
and validating such a plan with objects alone would take seconds. The builders, the validator
and the simulator therefore work on one ``int`` per step::

    code = kind_index << 56 | stage << 28 | micro

where ``kind_index`` is the position of the kind in :class:`StepKind` and an absent stage or
micro index is stored as 0. Every real step code stays below 2**60, which CPython stores in
two 30-bit digits: hashing and comparing them is measurably cheaper than three-digit ints
(:class:`PlanConfig` therefore caps stages and micro-batches at 2**28). Two properties are
relied on elsewhere (and named by the ``is_*`` predicates below):

- body kinds have the smallest indices, in the order ``F, B, I, W, Fsend, Frecv, Bsend, Brecv``
  (compute kinds first, the split backward's ``I`` and ``W`` right after ``B``), so "body step",
  "compute step", "forward of stage 0" are each one comparison, and each compute kind is one
  range;
- a send and the receive it pairs with differ by a constant per kind (:data:`PAIR_DELTA`),
  so pairing is one addition.

:class:`Step` objects are made from codes only when somebody asks for them (``Plan.orders``).
"""

from __future__ import annotations

from graph_exec.schedule.steps import BODY_KINDS, BODY_ORDER, GLOBAL_KINDS, STAGED_KINDS, Step, StepKind

KIND_SHIFT = 56
STAGE_SHIFT = 28
FIELD_MASK = (1 << STAGE_SHIFT) - 1
#: Adding this to a code moves it to the next stage.
STAGE_UNIT = 1 << STAGE_SHIFT

KINDS: tuple[StepKind, ...] = tuple(StepKind)
_INDEX = {kind: i for i, kind in enumerate(KINDS)}


def base(kind: StepKind) -> int:
    """The code of ``kind`` with stage and micro 0."""
    return _INDEX[kind] << KIND_SHIFT


F = base(StepKind.F)
B = base(StepKind.B)
I = base(StepKind.I)  # noqa: E741 - the step kind's own name
W = base(StepKind.W)
FSEND = base(StepKind.FSEND)
FRECV = base(StepKind.FRECV)
BSEND = base(StepKind.BSEND)
BRECV = base(StepKind.BRECV)
BCAST = base(StepKind.BCAST)
TFWD = base(StepKind.TFWD)
OUTSEND = base(StepKind.OUTSEND)
OUTRECV = base(StepKind.OUTRECV)
INSEND = base(StepKind.INSEND)
INRECV = base(StepKind.INRECV)
TBWD = base(StepKind.TBWD)
GRADSEND = base(StepKind.GRADSEND)
GRADRECV_BWD = base(StepKind.GRADRECV_BWD)
GRADREDUCE = base(StepKind.GRADREDUCE)
IDLE = base(StepKind.IDLE)

#: Every body code is below this, every MPipe code and IDLE at or above it.
BODY_LIMIT = (max(_INDEX[k] for k in BODY_KINDS) + 1) << KIND_SHIFT
if KINDS[: len(BODY_ORDER)] != BODY_ORDER or KINDS[-1] is not StepKind.IDLE:
    raise ImportError("StepKind must list the body kinds first, in steps.BODY_ORDER, and IDLE last")

#: ``send code + PAIR_DELTA[send kind] == code of the receive that takes the message``.
#: A forward message of stage s is received by stage s+1, a backward one by stage s-1.
PAIR_DELTA: dict[int, int] = {
    FSEND: FRECV - FSEND + STAGE_UNIT,
    BSEND: BRECV - BSEND - STAGE_UNIT,
    OUTSEND: OUTRECV - OUTSEND,
    INSEND: INRECV - INSEND,
    GRADSEND: GRADRECV_BWD - GRADSEND,
}
#: Send kind base -> the receive kind base that takes its message, and back.
RECV_OF_SEND: dict[int, int] = {
    FSEND: FRECV,
    BSEND: BRECV,
    OUTSEND: OUTRECV,
    INSEND: INRECV,
    GRADSEND: GRADRECV_BWD,
}
SEND_OF_RECV: dict[int, int] = {recv: send for send, recv in RECV_OF_SEND.items()}


# Predicates: what a code is, by name. They are plain range tests on the kind order checked
# above (F < B < I < W < Fsend < … < MPipe kinds < IDLE). The loops that visit every step of a
# large plan (p2p.insert_p2p, validate._scan, walk._rendezvous_rank) inline the same comparisons
# instead, because a function call per step there costs a measurable share of build_plan's time.


def is_forward(code: int) -> bool:
    """``F s.m`` on any stage."""
    return code < B


def is_backward(code: int) -> bool:
    """``B s.m`` (the whole backward) on any stage."""
    return B <= code < I


def is_input_backward(code: int) -> bool:
    """``I s.m`` on any stage: the input half of a split backward."""
    return I <= code < W


def is_weight_backward(code: int) -> bool:
    """``W s.m`` on any stage: the weight half of a split backward."""
    return W <= code < FSEND


def is_compute(code: int) -> bool:
    """``F``, ``B``, ``I`` or ``W``: the body's compute steps."""
    return code < FSEND


def is_stage0_forward(code: int) -> bool:
    """``F 0.m``: the forward that reads the batch or the preprocess output."""
    return code < STAGE_UNIT


def is_stage0_backward(code: int) -> bool:
    """``B 0.m``: the backward that leaves the gradient of the preprocess output."""
    return B <= code < B + STAGE_UNIT


def is_stage0_gradient_source(code: int) -> bool:
    """``B 0.m`` or ``I 0.m``: the step that leaves the gradient of the preprocess output."""
    return B <= code < B + STAGE_UNIT or I <= code < I + STAGE_UNIT


def is_body(code: int) -> bool:
    """A body step: compute (``F``, ``B``, ``I``, ``W``) or neighbour P2P (``Fsend`` … ``Brecv``)."""
    return code < BODY_LIMIT


def is_mpipe(code: int) -> bool:
    """A step MPipe layers on the body (``BCAST`` … ``GRADreduce``); neither body nor idle."""
    return BODY_LIMIT <= code < IDLE


def is_send(code: int) -> bool:
    """A step that sends a message to one peer rank."""
    return kind_base(code) in PAIR_DELTA


def is_recv(code: int) -> bool:
    """A step that receives a message from one peer rank."""
    return kind_base(code) in SEND_OF_RECV


def encode(kind: StepKind, stage: int | None = None, micro: int | None = None) -> int:
    """The code of one step (absent indices as 0)."""
    return base(kind) | (stage or 0) << STAGE_SHIFT | (micro or 0)


def encode_step(step: Step) -> int:
    """The code of a :class:`Step`."""
    return encode(step.kind, step.stage, step.micro)


def kind_base(code: int) -> int:
    """The code's kind as a base code (compare with :data:`F`, :data:`TBWD`, …)."""
    return code >> KIND_SHIFT << KIND_SHIFT


def stage_of(code: int) -> int:
    """The stage field (0 for kinds without a stage)."""
    return code >> STAGE_SHIFT & FIELD_MASK


def micro_of(code: int) -> int:
    """The micro field (0 for global kinds)."""
    return code & FIELD_MASK


# Per kind index: which fields the Step takes, so decoding needs no set lookups.
_FIELDS = tuple((k in STAGED_KINDS, k not in GLOBAL_KINDS) for k in KINDS)


def decode(code: int) -> Step:
    """The :class:`Step` of a code."""
    index = code >> KIND_SHIFT
    staged, has_micro = _FIELDS[index]
    return Step(
        KINDS[index],
        code >> STAGE_SHIFT & FIELD_MASK if staged else None,
        code & FIELD_MASK if has_micro else None,
    )


def token(code: int) -> str:
    """The token of a code (for error messages and exports)."""
    return decode(code).token
