"""Validation of a plan; ``build_plan`` runs it on every build.

What is checked (``docs/schedule.md``, "Invariants"):

1. body: removing every MPipe step gives exactly the body; no step appears twice on a rank;
   every ``F`` and ``B`` of every (stage, micro) appears once, on the rank of its stage (only
   the ``F`` in a forward-only plan; ``F``, ``I`` and ``W`` with the split backward of ``zb``);
2. MPipe steps: each rank has exactly the MPipe steps its options call for (one ``BCAST``
   or none, one ``TFWD`` per micro on its owner, the transfers, ``TBWD`` / ``GRADrecv+bwd``
   per the backward mode, ``GRADreduce`` last); ``TBWD m`` directly follows ``B 0.m`` (``I 0.m``); in
   ``min`` mode ``TFWD m`` directly precedes ``F 0.m`` for ``m >= NT`` (for every ``m``
   without transposition);
3. data dependencies: no step runs before the step that produces its input on its rank (a
   forward before its receive, a send before the compute that fills it, ``W s.m`` before
   ``I s.m``, …);
4. transfers: all ranks replayed with *blocking rendezvous* sends and receives (a transfer
   completes only when both ranks have reached it) and all-rank collectives must run to the
   end. When they do not, the cause is named as precisely as possible: a send or receive
   without its partner (``PairingError``), a rank pair whose send and receive orders differ
   (``FifoOrderError``), otherwise a ``DeadlockError`` with each stuck rank's next step.

How: plans reach millions of steps, so the common (valid) case costs one pass. A symbolic
execution of all ranks (:func:`_execute`) does 3 and 4 at once and records what 1 and 2 need
(the steps seen per rank, where the MPipe steps are), which then reduces to set and slice
comparisons. Only when something is wrong do the slower, precise checks run, in the order
above, so the error names the first cause rather than a downstream symptom.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from graph_exec.schedule import codes, routing
from graph_exec.schedule.codes import (
    BODY_LIMIT,
    KIND_SHIFT,
    STAGE_SHIFT,
    STAGE_UNIT,
    is_body,
    is_compute,
    is_mpipe,
    is_send,
    kind_base,
    micro_of,
    token,
)
from graph_exec.schedule.config import PlanConfig
from graph_exec.schedule.errors import (
    CoverageError,
    DeadlockError,
    DependencyError,
    FifoOrderError,
    InvariantError,
    PairingError,
)
from graph_exec.schedule.mpipe import inline_micros
from graph_exec.schedule.walk import RECV, ROLE, SEND, walk

Rows = Sequence[Sequence[int]]
_SHOWN = 6  # examples listed in an error message before "…"


class PlanCodes(Protocol):
    """What validation reads of a plan. :class:`~graph_exec.schedule.plan.Plan` is one; naming
    the attributes here rather than importing it keeps the plan module (which validates every
    plan it builds) and this one from importing each other."""

    config: PlanConfig
    order_codes: Rows  #: every rank's order
    body_codes: Rows  #: every rank's body order (no MPipe step)


def validate(plan: PlanCodes) -> None:
    """Raise a :class:`~graph_exec.schedule.errors.ScheduleError` if ``plan`` breaks an invariant."""
    config, orders, body = plan.config, plan.order_codes, plan.body_codes
    run = _execute(config, orders)
    if run.violation is None and run.complete(orders):
        if not _structure_ok(config, orders, body, run):
            _check_structure(config, orders, body)
            raise InvariantError("plan failed a structural check that the detailed checks did not explain")
        _check_mpipe_order(config, orders, run.mpipe_at[0])
        return
    _check_structure(config, orders, body)
    if run.violation is not None:
        rank, index, code, need = run.violation
        raise DependencyError(
            f"rank {rank}: {token(code)} (step #{index}) runs before {token(need)}, which it depends on"
        )
    _check_pairing(config, orders)
    _check_fifo(config, orders)
    _raise_deadlock(config, orders, run.pos)


# The replay: each rank's inputs (check 3), then the ranks against each other (check 4).


@dataclass
class _Run:
    """What the replay found, and what each rank's order holds for the structural checks."""

    pos: list[int]  # per rank: where it waits, or the length of its order once done
    seen: list[set[int]]  # per rank: every step of its order
    compute: list[int]  # per rank: F, B, I and W steps
    mpipe_at: list[list[int]]  # per rank: indices of the MPipe steps
    violation: tuple[int, int, int, int] | None = None  # rank, index, step, missing input

    def complete(self, orders: Rows) -> bool:
        return all(p == len(row) for p, row in zip(self.pos, orders, strict=True))


def _mpipe_needs(config: PlanConfig, code: int) -> tuple[int, ...]:
    """The steps that must run before an MPipe step on its rank."""
    kind, m = kind_base(code), micro_of(code)
    gradient = _gradient_source(config)  # leaves dL/d(preprocess output) of m: B 0.m or I 0.m
    if kind == codes.TFWD:
        return (codes.BCAST,) if config.broadcasts else ()
    if kind in (codes.OUTSEND, codes.GRADRECV_BWD):
        return (codes.TFWD | m,)
    if kind == codes.GRADSEND:
        return (gradient | m,)
    if kind == codes.TBWD:
        shipped = config.ships_inputs and config.owner(m) != 0
        return (gradient | m, codes.INRECV | m) if shipped else (gradient | m,)
    return ()


def _gradient_source(config: PlanConfig) -> int:
    """The kind of the step that makes a stage's input gradient: ``I`` (split backward) or ``B``."""
    return codes.I if config.split_backward else codes.B


def _execute(config: PlanConfig, orders: Rows) -> _Run:
    """Check every rank's inputs, then replay the ranks with rendezvous transfers.

    The replay (:func:`~graph_exec.schedule.walk.walk`) stops at the first step, in replay
    order, whose input was never produced on its rank, as a run would; that step is the
    violation reported.
    """
    scans = [_scan(config, row, rank) for rank, row in enumerate(orders)]
    first = [scan.violation[1] if scan.violation else None for scan in scans]
    replay = walk(orders, rendezvous=True, stop_at=first)
    run = _Run(replay.pos, [s.seen for s in scans], [s.compute for s in scans], [s.mpipe_at for s in scans])
    if replay.stopped is not None:
        run.violation = scans[replay.stopped[0]].violation
    return run


@dataclass
class _Scan:
    """One rank's order read alone: its steps, and the first step whose input it lacks."""

    seen: set[int]
    compute: int
    mpipe_at: list[int]
    violation: tuple[int, int, int, int] | None  # rank, index, step, missing input


def _scan(config: PlanConfig, row: Sequence[int], rank: int) -> _Scan:
    """Check 3 on one rank: every step's input is produced earlier on the rank.

    This loop visits every step of every rank (1.6 million for P=64 V=4 M=1024), so it tests
    kinds by raw comparison with the locals below, not with the codes.is_* predicates: a
    function call per step would add a measurable share of build_plan's time.
    """
    pp = config.pp
    # What F s.m and B s.m read from a neighbouring stage: a receive, or with a single rank
    # the neighbour's own step.
    f_input = -STAGE_UNIT if pp == 1 else codes.FRECV - codes.F
    b_input = STAGE_UNIT if pp == 1 else codes.BRECV - codes.B
    b_has_next = codes.B | config.last_stage << STAGE_SHIFT  # B codes below have a next stage
    # The split backward (zb): I s.m reads what B s.m read; W s.m reads what I s.m kept.
    i_input = STAGE_UNIT if pp == 1 else codes.BRECV - codes.I
    i_has_next = codes.I | config.last_stage << STAGE_SHIFT
    i_code, w_code, f_to_i, i_to_w = codes.I, codes.W, codes.I - codes.F, codes.W - codes.I
    stage0_input: dict[int, int] = {}  # F 0.m (code m) -> what it reads under MPipe
    if config.mpipe:
        for m in range(config.micro):
            stage0_input[m] = (codes.TFWD if config.owner(m) == 0 else codes.OUTRECV) | m
    fsend_to_f, bsend_to_b = codes.FSEND - codes.F, codes.BSEND - _gradient_source(config)
    fsend, frecv, bsend, brecv, b_code = codes.FSEND, codes.FRECV, codes.BSEND, codes.BRECV, codes.B
    have: set[int] = set()
    add = have.add
    mpipe_at: list[int] = []
    n_compute = 0

    def lacking(index: int, code: int, need: int) -> _Scan:
        return _Scan(set(row), n_compute, mpipe_at, (rank, index, code, need))

    for i, code in enumerate(row):
        add(code)
        if code < fsend:  # F, B, I or W: check the input it reads
            n_compute += 1
            if code < b_code:  # F s.m
                # Stage 0 reads the batch without MPipe: then "need" is the step itself (seen).
                need = code + f_input if code >= STAGE_UNIT else stage0_input.get(code, code)
            elif code < i_code:  # B s.m: its own forward, then the gradient from the next stage
                if code - b_code not in have:
                    return lacking(i, code, code - b_code)
                need = code + b_input if code < b_has_next else code
            elif code < w_code:  # I s.m: as B s.m
                if code - f_to_i not in have:
                    return lacking(i, code, code - f_to_i)
                need = code + i_input if code < i_has_next else code
            else:  # W s.m: what I s.m kept
                need = code - i_to_w
            if need not in have:
                return lacking(i, code, need)
        elif code < frecv:  # Fsend s.m: after F s.m
            if code - fsend_to_f not in have:
                return lacking(i, code, code - fsend_to_f)
        elif code < bsend:  # a receive needs nothing on its rank
            continue
        elif code < brecv:  # Bsend s.m: after B s.m (I s.m)
            if code - bsend_to_b not in have:
                return lacking(i, code, code - bsend_to_b)
        elif code >= BODY_LIMIT:  # MPipe step: rare, so the general rules
            mpipe_at.append(i)
            for need in _mpipe_needs(config, code):
                if need not in have:
                    return lacking(i, code, need)
    return _Scan(have, n_compute, mpipe_at, None)


# Structure (checks 1 and 2): fast form on a complete run, precise form for messages.


def _compute_kinds(config: PlanConfig) -> tuple[int, ...]:
    """The compute kinds every (stage, micro) runs: ``F`` and ``B``, ``F``, ``I`` and ``W`` (split
    backward), or ``F`` alone (forward-only)."""
    if config.forward_only:
        return (codes.F,)
    return (codes.F, codes.I, codes.W) if config.split_backward else (codes.F, codes.B)


def _compute_bases(config: PlanConfig, rank: int) -> list[int]:
    """The codes of ``F s.0`` (and ``B s.0``, or ``I s.0`` and ``W s.0``) for the stages of ``rank``:
    micros follow contiguously."""
    stages = range(rank, config.num_stages, config.pp)
    return [kind | s << STAGE_SHIFT for kind in _compute_kinds(config) for s in stages]


def _expected_compute(config: PlanConfig, rank: int) -> list[int]:
    """The compute steps of ``rank``, sorted."""
    return [first + m for first in _compute_bases(config, rank) for m in range(config.micro)]


def _expected_mpipe(config: PlanConfig) -> list[list[int]]:
    """The MPipe steps each rank must hold (sorted), straight from the option semantics."""
    rows: list[list[int]] = [[] for _ in range(config.pp)]
    if not config.mpipe:
        return rows
    owner_backward = config.backward == "owner" and not config.forward_only
    backward = not config.forward_only
    for m in range(config.micro):
        owner = config.owner(m)
        rows[owner].append(codes.TFWD | m)
        if owner != 0:
            rows[owner].append(codes.OUTSEND | m)
            rows[0].append(codes.OUTRECV | m)
            if config.ships_inputs:
                rows[owner].append(codes.INSEND | m)
                rows[0].append(codes.INRECV | m)
            if owner_backward:
                rows[0].append(codes.GRADSEND | m)
                rows[owner].append(codes.GRADRECV_BWD | m)
        if backward and config.trainable and (not owner_backward or owner == 0):
            rows[0].append(codes.TBWD | m)
    for row in rows:
        row += [codes.BCAST] * config.broadcasts + [codes.GRADREDUCE] * owner_backward
        row.sort()
    return rows


def _strip_matches(row: Sequence[int], body_row: Sequence[int], mpipe_at: list[int]) -> bool:
    """Whether ``row`` without the steps at ``mpipe_at`` is ``body_row`` (slice compares only)."""
    done = start = 0
    for stop in [*mpipe_at, len(row)]:
        length = stop - start
        if row[start:stop] != body_row[done : done + length]:
            return False
        done, start = done + length, stop + 1
    return done == len(body_row)


def _structure_ok(config: PlanConfig, orders: Rows, body: Rows, run: _Run) -> bool:
    """Checks 1 and 2 from what a complete run saw (no step repeats, so sizes tell)."""
    compute_steps = len(_compute_kinds(config)) * config.vpp * config.micro
    expected_mpipe = _expected_mpipe(config)
    for rank, row in enumerate(orders):
        seen, mpipe_at = run.seen[rank], run.mpipe_at[rank]
        if (
            len(seen) != len(row)
            or run.compute[rank] != compute_steps
            or not all(
                seen.issuperset(range(first, first + config.micro)) for first in _compute_bases(config, rank)
            )
            or sorted(row[i] for i in mpipe_at) != expected_mpipe[rank]
            or not _strip_matches(row, body[rank], mpipe_at)
        ):
            return False
    return True


def _tokens(items: Iterable[int]) -> str:
    items = list(items)
    shown = " ".join(map(token, items[:_SHOWN]))
    return shown + (f" … ({len(items)} in all)" if len(items) > _SHOWN else "")


def _difference(got: Sequence[int], expected: Sequence[int]) -> str:
    have, want = Counter(got), Counter(expected)
    parts = []
    if missing := sorted((want - have).elements()):
        parts.append(f"missing {_tokens(missing)}")
    if extra := sorted((have - want).elements()):
        parts.append(f"unexpected or repeated {_tokens(extra)}")
    return "; ".join(parts)


def _check_structure(config: PlanConfig, orders: Rows, body: Rows) -> None:
    """Checks 1 and 2, precisely: raise naming the first rank and steps that are wrong."""
    expected_mpipe = _expected_mpipe(config)
    for rank, (row, body_row) in enumerate(zip(orders, body, strict=True)):
        stripped = [code for code in row if is_body(code)]
        if stripped != list(body_row):
            at = next(
                (i for i, (a, b) in enumerate(zip(stripped, body_row, strict=False)) if a != b),
                min(len(stripped), len(body_row)),
            )
            want = token(body_row[at]) if at < len(body_row) else "the end"
            got = token(stripped[at]) if at < len(stripped) else "the end"
            raise InvariantError(
                f"rank {rank}: removing the MPipe steps does not give the body: "
                f"body step #{at} is {want}, the order has {got}"
            )
        if repeated := [code for code, n in Counter(row).items() if n > 1]:
            raise CoverageError(f"rank {rank}: steps appear more than once: {_tokens(sorted(repeated))}")
        expected = _expected_compute(config, rank)
        compute = sorted(code for code in stripped if is_compute(code))
        if compute != expected:
            what = "F" if config.forward_only else "F, I and W" if config.split_backward else "F and B"
            raise CoverageError(
                f"rank {rank} must run {what} of stages {list(range(rank, config.num_stages, config.pp))} "
                f"for micros 0..{config.micro - 1} exactly once: {_difference(compute, expected)}"
            )
        mpipe = sorted(code for code in row if is_mpipe(code))
        if mpipe != expected_mpipe[rank]:
            raise InvariantError(
                f"rank {rank}: MPipe steps do not match preprocess {config.preprocess!r}, "
                f"run_ahead {config.run_ahead!r}, backward {config.backward!r}, input {config.input!r}: "
                f"{_difference(mpipe, expected_mpipe[rank])}"
            )
    _check_mpipe_order(config, orders, [i for i, code in enumerate(orders[0]) if is_mpipe(code)])


def _check_mpipe_order(config: PlanConfig, orders: Rows, mpipe_at0: list[int]) -> None:
    """Where MPipe steps must sit: TBWD after B 0.m (I 0.m), inline TFWD before F 0.m, GRADreduce last."""
    if config.backward == "owner" and not config.forward_only:
        for rank, row in enumerate(orders):
            if row[-1] != codes.GRADREDUCE:
                raise InvariantError(f"rank {rank}: GRADreduce must be the last step, {token(row[-1])} is")
    row0 = orders[0]
    inline = inline_micros(config)
    gradient = _gradient_source(config)
    for i in mpipe_at0:
        kind, m = kind_base(row0[i]), micro_of(row0[i])
        if kind == codes.TBWD and (i == 0 or row0[i - 1] != gradient | m):
            raise InvariantError(f"rank 0: TBWD{m} must directly follow {token(gradient | m)}")
        if kind == codes.TFWD and m in inline and (i + 1 == len(row0) or row0[i + 1] != codes.F | m):
            why = "with run_ahead 'min'" if config.transpose else "without transposition"
            raise InvariantError(f"rank 0: {why}, TFWD{m} must directly precede F0.{m}")


# Transfers (check 4): precise causes of a replay that stopped.


def _messages(config: PlanConfig, orders: Rows) -> tuple[dict, dict]:
    """Per (sender, receiver): message keys in send order and in receive order.

    A message's key is the code of its send step; a receive names the send it takes.
    """
    sent: dict[tuple[int, int | None], list[int]] = defaultdict(list)
    received: dict[tuple[int | None, int], list[int]] = defaultdict(list)
    for rank, row in enumerate(orders):
        for code in row:
            what = ROLE[code >> KIND_SHIFT]
            if what == SEND:
                sent[rank, routing.peer(config, code)].append(code)
            elif what == RECV:
                received[routing.peer(config, code), rank].append(routing.partner_code(code))
    return sent, received


def _check_pairing(config: PlanConfig, orders: Rows) -> None:
    sent, received = _messages(config, orders)
    problems = []
    for pair in sorted(set(sent) | set(received), key=str):
        have, want = Counter(received.get(pair, ())), Counter(sent.get(pair, ()))
        src, dst = pair
        for key in sorted((want - have).elements()):
            problems.append(f"rank {src} sends {token(key)} to rank {dst}, which never receives it")
        for key in sorted((have - want).elements()):
            problems.append(
                f"rank {dst} runs {token(routing.partner_code(key))} from rank {src}, which never sends it"
            )
    if problems:
        more = f"\n  … ({len(problems)} in all)" if len(problems) > _SHOWN else ""
        raise PairingError("unpaired transfers:\n  " + "\n  ".join(problems[:_SHOWN]) + more)


def _check_fifo(config: PlanConfig, orders: Rows) -> None:
    sent, received = _messages(config, orders)
    for (src, dst), keys in sorted(sent.items(), key=str):
        for n, (key, got) in enumerate(zip(keys, received.get((src, dst), ()), strict=False)):
            if key != got:
                raise FifoOrderError(
                    f"ranks {src}->{dst}: send #{n} is {token(key)} but receive #{n} is "
                    f"{token(routing.partner_code(got))}; a FIFO transport pairs them in order"
                )


def _raise_deadlock(config: PlanConfig, orders: Rows, pos: list[int]) -> None:
    stuck = {}
    for rank, (p, row) in enumerate(zip(pos, orders, strict=True)):
        if p < len(row):
            code = row[p]
            peer = routing.peer(config, code)
            if peer is None:
                stuck[rank] = f"{token(code)} (until every rank reaches it)"
            else:
                direction = "to" if is_send(code) else "from"
                stuck[rank] = f"{token(code)} ({direction} rank {peer})"
    lines = "\n".join(f"  rank {rank} waits at {what}" for rank, what in stuck.items())
    raise DeadlockError(f"blocking-rendezvous replay deadlocks:\n{lines}", stuck)
