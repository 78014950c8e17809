"""Who talks to whom: the rank a step must run on and the peer of a send or receive.

One set of rules shared by the plan's public ``peer``, the validator, the exports and the
simulator, so they cannot disagree about where a message goes.
"""

from __future__ import annotations

from graph_exec.schedule import codes
from graph_exec.schedule.codes import (
    PAIR_DELTA,
    SEND_OF_RECV,
    decode,
    encode_step,
    kind_base,
    micro_of,
    stage_of,
)
from graph_exec.schedule.config import PlanConfig
from graph_exec.schedule.steps import Step

_STAGED_NEXT = (codes.FSEND, codes.BRECV)  # talk to the rank of stage s+1
_STAGED_PREV = (codes.FRECV, codes.BSEND)  # talk to the rank of stage s-1
_TO_ZERO = (codes.OUTSEND, codes.INSEND, codes.GRADRECV_BWD)  # run on the owner, talk to rank 0
_FROM_OWNER = (codes.OUTRECV, codes.INRECV, codes.GRADSEND)  # run on rank 0, talk to the owner
#: The kinds whose micro fixes their rank: the preprocess forward runs where the micro is owned.
_ON_OWNER = (*_TO_ZERO, codes.TFWD)
_ON_ZERO = (*_FROM_OWNER, codes.TBWD)


def peer(config: PlanConfig, code: int) -> int | None:
    """The other rank of a send or receive step; ``None`` for every other step."""
    kind = kind_base(code)
    if kind in _STAGED_NEXT:
        return config.stage_rank(stage_of(code) + 1)
    if kind in _STAGED_PREV:
        return config.stage_rank(stage_of(code) - 1)
    if kind in _TO_ZERO:
        return 0
    if kind in _FROM_OWNER:
        return config.owner(micro_of(code))
    return None


def home(config: PlanConfig, code: int) -> int | None:
    """The rank a step must run on; ``None`` for steps every rank runs (BCAST, GRADreduce)."""
    if codes.is_body(code):
        return config.stage_rank(stage_of(code))
    kind = kind_base(code)
    if kind in _ON_OWNER:
        return config.owner(micro_of(code))
    if kind in _ON_ZERO:
        return 0
    return None


def partner_code(code: int) -> int:
    """The code of the other half of a send or receive."""
    kind = kind_base(code)
    if kind in PAIR_DELTA:
        return code + PAIR_DELTA[kind]
    return code - PAIR_DELTA[SEND_OF_RECV[kind]]


def partner(step: Step) -> Step:
    """The other half of a send or receive step (``Frecv1.0`` -> ``Fsend0.0``)."""
    return decode(partner_code(encode_step(step)))
