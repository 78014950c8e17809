"""The one replay of a plan: every rank runs its order, event-driven (``docs/schedule.md``,
"Replaying a plan").

Validation, simulation and tower placement all need to run the ranks' orders against each
other: a receive waits for its message, a collective for every rank. :func:`walk` does that
once for all of them. Each rank is a generator that runs until it has to wait and is resumed
by whoever unblocks it, so a plan of 1.6 million steps replays in one pass.

Two transfer semantics:

- **buffered** (the default; simulation, placement): a send never waits; its message is at the
  receiver ``cost(send)`` after it. Steps get times: a step starts when its rank is free and
  (a receive) its message is there, or (a collective) every rank has arrived, and lasts
  ``cost(code)`` (:func:`graph_exec.schedule.costs.step_cost`).
- **rendezvous** (validation): a transfer completes only once both ranks have reached it, the
  strictest transport; a plan that finishes under it finishes under any. Untimed.

A walk that cannot finish stops where every rank waits; :attr:`Walk.pos` says where.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

from graph_exec.schedule import codes
from graph_exec.schedule.codes import BODY_LIMIT, KIND_SHIFT, PAIR_DELTA, SEND_OF_RECV
from graph_exec.schedule.costs import Cost

Rows = Sequence[Sequence[int]]
#: A step of the walk: (rank, index in its order).
Place = tuple[int, int]

#: What a step does in a replay: runs on its rank alone, sends, receives, or waits for every rank.
COMPUTE, SEND, RECV, COLLECTIVE = range(4)
#: Each step kind's role, by kind index (``ROLE[code >> KIND_SHIFT]``).
ROLE = [COMPUTE] * len(codes.KINDS)
for _kind in PAIR_DELTA:
    ROLE[_kind >> KIND_SHIFT] = SEND
for _kind in SEND_OF_RECV:
    ROLE[_kind >> KIND_SHIFT] = RECV
for _kind in (codes.BCAST, codes.GRADREDUCE):
    ROLE[_kind >> KIND_SHIFT] = COLLECTIVE


@dataclass
class Walk:
    """How far a walk got and, timed, when each step ran."""

    pos: list[int]  #: per rank: the index it waits at, or the length of its order once done
    stopped: Place | None = None  #: the ``stop_at`` place the walk ended at
    busy: list[float] = field(default_factory=list)  #: per rank: time in compute and collectives
    #: Per rank, in order (``record=True``): (code, start, end); a receive starts when its rank
    #: reaches it and ends when its message is there (plus its own work).
    steps: list[list[tuple[int, float, float]]] = field(default_factory=list)
    #: Every step in an order its dependencies respect (``record=True``); a collective is one
    #: group of every rank's place, the rest groups of one.
    replay: list[tuple[Place, ...]] = field(default_factory=list)

    def complete(self, rows: Rows) -> bool:
        """Whether every rank ran its whole order."""
        return all(p == len(row) for p, row in zip(self.pos, rows, strict=True))


class _Shared:
    """What the ranks of one walk share: messages, waiting ranks, collectives."""

    def __init__(self, ranks: int) -> None:
        self.work = list(range(ranks))  # ranks ready to run, the last first
        self.arrival: dict[int, float] = {}  # buffered: receive code -> when its message is there
        self.waiter: dict[int, int] = {}  # receive code -> the rank waiting for its message / sender
        self.sender: dict[int, int] = {}  # rendezvous: receive code -> the sender waiting at it
        self.arrived: dict[int, list[tuple[int, float]]] = {}  # collective -> (rank, clock) there
        self.finished: dict[int, float] = {}  # collective -> its end time


def walk(
    rows: Rows,
    cost: Cost | None = None,
    *,
    rendezvous: bool = False,
    stop_at: Sequence[int | None] | None = None,
    record: bool = False,
) -> Walk:
    """Replay ``rows`` (one order of step codes per rank) until every rank is done or waits.

    ``cost`` prices the steps of a buffered walk (``None``: every step free). A rendezvous walk
    is untimed and may stop early: ``stop_at[rank]`` is an index that rank must not run, and the
    walk ends when a rank reaches it (validation stops at a step whose input was never
    produced). ``record`` keeps :attr:`Walk.steps` and :attr:`Walk.replay` of a buffered walk.
    """
    if rendezvous and (cost is not None or record):
        raise ValueError("a rendezvous walk is untimed: pass neither cost nor record")
    if stop_at is not None and not rendezvous:
        raise ValueError("stop_at applies to rendezvous walks only")
    ranks = len(rows)
    result = Walk([0] * ranks, busy=[0.0] * ranks)
    shared = _Shared(ranks)
    if rendezvous:
        stops = stop_at or [None] * ranks
        runners = [_rendezvous_rank(rows[r], r, stops[r], shared, result) for r in range(ranks)]
    else:
        if record:
            result.steps = [[] for _ in range(ranks)]
        runners = [_buffered_rank(rows[r], r, cost or _free, shared, result, record) for r in range(ranks)]
    work = shared.work
    while work and result.stopped is None:
        next(runners[work.pop()], None)
    return result


def _free(code: int) -> float:
    """The cost of every step of an unpriced walk."""
    return 0.0


def _buffered_rank(
    row: Sequence[int], rank: int, price: Cost, shared: _Shared, result: Walk, record: bool
) -> Iterator[None]:
    """One rank of a buffered walk; yields while it waits for a message or a collective."""
    role, shift, delta = ROLE, KIND_SHIFT, PAIR_DELTA
    busy, replay = result.busy, result.replay
    out = result.steps[rank] if record else None
    clock = 0.0
    for i, code in enumerate(row):
        start = clock
        what = role[code >> shift]
        if what == COMPUTE:
            spent = price(code)
            clock += spent
            busy[rank] += spent
        elif what == SEND:  # buffered: the message travels on its own
            message = code + delta[codes.kind_base(code)]
            shared.arrival[message] = clock + price(code)
            if message in shared.waiter:
                shared.work.append(shared.waiter.pop(message))
        elif what == RECV:
            while code not in shared.arrival:
                result.pos[rank] = i
                shared.waiter[code] = rank
                yield
            spent = price(code)  # the receive's own work, e.g. GRADrecv+bwd's recompute
            clock = max(clock, shared.arrival.pop(code)) + spent
            busy[rank] += spent
        else:
            clock = yield from _collective(code, i, rank, clock, price, shared, result, record)
            busy[rank] += price(code)
            if out is not None:
                out.append((code, start, clock))
            continue
        if out is not None:
            out.append((code, start, clock))
            replay.append(((rank, i),))
    result.pos[rank] = len(row)


def _collective(
    code: int,
    index: int,
    rank: int,
    clock: float,
    price: Cost,
    shared: _Shared,
    result: Walk,
    record: bool,
) -> Generator[None, None, float]:
    """A collective on one rank: it starts when the last rank arrives; returns its end time."""
    ranks = len(result.pos)
    there = shared.arrived.setdefault(code, [])
    there.append((rank, clock))
    if len(there) == ranks:
        shared.finished[code] = max(c for _, c in there) + price(code)
        if record:
            result.replay.append(tuple(sorted((r, result.pos[r] if r != rank else index) for r, _ in there)))
        shared.work.extend(r for r, _ in there if r != rank)
    while code not in shared.finished:
        result.pos[rank] = index
        yield
    return shared.finished[code]


def _rendezvous_rank(
    row: Sequence[int], rank: int, stop: int | None, shared: _Shared, result: Walk
) -> Iterator[None]:
    """One rank of a rendezvous walk; yields while its transfer's partner or a collective is
    not there yet.

    This loop visits every step of every rank (1.6 million for P=64 V=4 M=1024), so compute
    steps cost one comparison (they are the kinds below ``Fsend``) and body transfers find
    their message by raw arithmetic.
    """
    fsend, frecv, bsend, brecv = codes.FSEND, codes.FRECV, codes.BSEND, codes.BRECV
    d_f, d_b = PAIR_DELTA[fsend], PAIR_DELTA[bsend]
    role, shift, delta = ROLE, KIND_SHIFT, PAIR_DELTA
    pos, work, waiter, sender, arrived = result.pos, shared.work, shared.waiter, shared.sender, shared.arrived
    ranks = len(pos)
    end = len(row) if stop is None else stop
    for i in range(end):
        code = row[i]
        if code < fsend:
            continue
        if code < BODY_LIMIT:  # body transfer: sends pair with code + delta
            if code < frecv:
                message, sending = code + d_f, True
            elif code < bsend:
                message, sending = code, False
            elif code < brecv:
                message, sending = code + d_b, True
            else:
                message, sending = code, False
        else:
            what = role[code >> shift]
            if what == COMPUTE:
                continue
            if what == COLLECTIVE:
                there = arrived.setdefault(code, [])
                there.append((rank, 0.0))
                if len(there) < ranks:
                    pos[rank] = i
                    yield
                    continue
                del arrived[code]
                work.extend(r for r, _ in there if r != rank)
                continue
            sending = what == SEND
            message = code + delta[codes.kind_base(code)] if sending else code
        # A transfer: done if the partner waits at it, else wait for the partner to come.
        partner = waiter.pop(message, None) if sending else sender.pop(message, None)
        if partner is not None:
            work.append(partner)
            continue
        (sender if sending else waiter)[message] = rank
        pos[rank] = i
        yield
    pos[rank] = end
    if stop is not None and end == stop:
        result.stopped = (rank, stop)
