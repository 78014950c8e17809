"""P2P insertion: turn compute slots into orders with sends and receives.

The rule is ``docs/schedule.md``, "P2P insertion": a column scan walks the slots in time order. At slot ``t`` every rank first
takes its own item; then, even ranks first and odd ranks second, each ``F s.m`` whose next
stage lives on another rank appends ``Fsend s.m`` to its own list and ``Frecv (s+1).m`` to
the receiver's, and each ``B s.m`` (or, split backward, ``I s.m``) with ``s > 0`` appends
``Bsend s.m`` / ``Brecv (s-1).m`` likewise. ``W s.m`` sends nothing.

Why this order: both halves of a message are appended at the same moment of one global
sequence, so replaying that sequence pairs every send with its receive — the orders cannot
deadlock under a blocking transport, and per rank pair the send order equals the receive
order. Because the slots are causal, the receive also lands before the step that reads it.

Only three ranks ever append to rank ``q``'s list: ``q`` itself (its sends), ``q-1`` (a
forward message) and ``q+1`` (a backward message). So each rank's list is built on its own
from those three rows, in the order the scan would visit them — the same result as the
column-by-column scan, with each rank's step codes allocated together, which makes every
later pass over a row markedly faster (fewer cache misses).
"""

from __future__ import annotations

from itertools import zip_longest

from graph_exec.schedule import codes
from graph_exec.schedule.codes import STAGE_UNIT

# Pads short rows in the scan; larger than every real code so no kind test matches it.
_PAD = codes.IDLE + (1 << codes.KIND_SHIFT)


def _scan_position(rank: int) -> tuple[int, int]:
    """Where the column scan visits ``rank``: even ranks first, then odd ranks, ascending."""
    return rank % 2, rank


def insert_p2p(slots: list[list[int]], pp: int, vpp: int, keep_idle: bool) -> list[list[int]]:
    """The body orders with P2P steps (one list per rank), idle slots kept only if asked."""
    keep_below = _PAD if keep_idle else codes.IDLE
    if pp == 1:  # every stage on one rank: data stays local
        return [[code for code in row if code < keep_below] for row in slots]
    last_forward = (pp * vpp - 1) << codes.STAGE_SHIFT  # F codes below this have a next stage
    first_backward = codes.B + STAGE_UNIT  # B codes from here up to I have a previous stage
    first_input = codes.I + STAGE_UNIT  # I codes from here up to W have a previous stage
    i_base, w_base = codes.I, codes.W
    to_fsend = codes.FSEND - codes.F
    to_frecv = codes.FRECV - codes.F + STAGE_UNIT
    to_bsend = codes.BSEND - codes.B
    to_brecv = codes.BRECV - codes.B - STAGE_UNIT
    i_to_bsend = codes.BSEND - codes.I
    i_to_brecv = codes.BRECV - codes.I - STAGE_UNIT
    # The loop below visits every slot of every rank, so it tests kinds by raw comparison with
    # the locals above rather than with the codes.is_* predicates: a function call per slot
    # would add a measurable share of build_plan's time.
    rows = []
    for q in range(pp):
        left, right = (q - 1) % pp, (q + 1) % pp
        # Index into (own send, receive from the left, receive from the right), in scan order.
        order = sorted(range(3), key=lambda k: _scan_position((q, left, right)[k]))
        out: list[int] = []
        append = out.append
        for own, sent_f, sent_b in zip_longest(slots[q], slots[left], slots[right], fillvalue=_PAD):
            if own < keep_below:
                append(own)
            if own < last_forward:
                mine = own + to_fsend
            elif first_backward <= own < i_base:
                mine = own + to_bsend
            elif first_input <= own < w_base:
                mine = own + i_to_bsend
            else:
                mine = 0  # no step code is 0 among sends and receives
            from_left = sent_f + to_frecv if sent_f < last_forward else 0
            if first_backward <= sent_b < i_base:
                from_right = sent_b + to_brecv
            elif first_input <= sent_b < w_base:
                from_right = sent_b + i_to_brecv
            else:
                from_right = 0
            if mine or from_left or from_right:
                found = (mine, from_left, from_right)
                for k in order:
                    if found[k]:
                        append(found[k])
        rows.append(out)
    return rows
