"""Body builders: the compute steps (``F`` / ``B``) of each rank, with idle slots.

Each builder returns one list per rank of step codes (see :mod:`codes`) in *slots*: one slot
per compute step, ``codes.IDLE`` where the rank waits. The slots matter beyond display: the
P2P column scan (:mod:`p2p`) walks them in time order, so a message is always inserted into
the receiver's list before the slot that consumes it.

- :func:`interleaved` follows ``docs/schedule.md``, "Interleaved 1F1B" exactly, idle slots
  included, because the order of the P2P steps (and so the worked examples) depends on where
  those idle slots fall.
- :func:`one_f_one_b` and :func:`gpipe` (``docs/schedule.md``, "Plain 1F1B and GPipe") only
  define each rank's compute *order*; their slots come from :func:`unit_time_slots`, a
  unit-cost replay of that order, which is causal by construction. So do :func:`forwards`,
  the forward-only order of an evaluation plan (``docs/schedule.md``, "Forward-only plans").
- :func:`zero_bubble` (``docs/schedule.md``, "Zero bubble") splits each backward into ``I`` and
  ``W`` and places them itself, with a unit-time list schedule of all ranks: its slots are causal
  by construction too.
"""

from __future__ import annotations

from graph_exec.schedule import codes
from graph_exec.schedule.codes import IDLE, STAGE_SHIFT
from graph_exec.schedule.config import PlanConfig
from graph_exec.schedule.errors import ScheduleError


def build_slots(config: PlanConfig) -> list[list[int]]:
    """The compute slots of every rank for ``config.body`` (forward-only: :func:`forwards`)."""
    pp, vpp, micro = config.pp, config.vpp, config.micro
    if config.forward_only:
        return unit_time_slots(pp, vpp, forwards(pp, vpp, micro))
    if config.body == "interleaved":
        return interleaved(pp, vpp, micro)
    if config.body == "1f1b":
        return unit_time_slots(pp, vpp, one_f_one_b(pp, micro))
    if config.body == "zb":
        return zero_bubble(pp, vpp, micro)
    return unit_time_slots(pp, vpp, gpipe(pp, vpp, micro))


def _rounds(pp: int, micro: int) -> list[int]:
    """Micro-batches per round: ``M`` spread over ``max(1, M // P)`` rounds, extras first."""
    if micro < pp:
        return [micro]
    n_rounds = micro // pp
    base, rem = divmod(micro % pp, n_rounds)
    return [pp + base + (1 if k < rem else 0) for k in range(n_rounds)]


def _op_sequence(rounds: list[int], vpp: int) -> tuple[list[int], list[int]]:
    """The chunk and the micro of forward op ``o`` (the same on every rank).

    Forward op o runs chunk (o - A[a]) // R_a of its round a: R_a ops of chunk 0, then R_a of
    chunk 1, ... Backward op o mirrors the chunk (V-1-chunk) and, as the mirrored chunks repeat
    the same pattern, takes the same micro counter value.
    """
    chunk_of: list[int] = []
    for size in rounds:
        for chunk in range(vpp):
            chunk_of.extend([chunk] * size)
    counters = [0] * vpp
    micro_of: list[int] = []
    for chunk in chunk_of:
        micro_of.append(counters[chunk])
        counters[chunk] += 1
    return chunk_of, micro_of


def interleaved(pp: int, vpp: int, micro: int) -> list[list[int]]:
    """Interleaved 1F1B slots, exactly as ``docs/schedule.md``, "Interleaved 1F1B" says."""
    rounds = _rounds(pp, micro)
    chunk_of, micro_of = _op_sequence(rounds, vpp)
    total = micro * vpp
    short = micro < pp  # extra idle slots for fewer micros than ranks
    last_micro = micro - 1
    slots = []
    for rank in range(pp):
        fwd = [codes.F | (c * pp + rank) << STAGE_SHIFT | m for c, m in zip(chunk_of, micro_of, strict=True)]
        bwd = [
            codes.B | ((vpp - 1 - c) * pp + rank) << STAGE_SHIFT | m
            for c, m in zip(chunk_of, micro_of, strict=True)
        ]
        down = pp - 1 - rank  # ranks downstream of this one
        warmup = min((vpp - 1) * rounds[0] + 2 * down, total)
        row = [IDLE] * rank
        for op in range(warmup):
            row.append(fwd[op])
            if short and micro_of[op] == last_micro and not (op == warmup - 1 and rank != pp - 1):
                row.extend([IDLE] * (pp - micro))
        row.extend([IDLE] * (max(0, 2 * down - micro) + down))
        for op in range(total - warmup):
            row.append(fwd[warmup + op])
            row.append(bwd[op])
            if short and rank == pp - 1 and micro_of[op] == last_micro:
                row.extend([IDLE] * (2 * (pp - micro)))
        for op in range(total - warmup, total):
            row.append(IDLE)
            row.append(bwd[op])
            if short and micro_of[op] == last_micro:
                row.extend([IDLE] * (2 * (pp - micro)))
        slots.append(row)
    return slots


def zb_activation_limit(pp: int, vpp: int, micro: int) -> int:
    """How many micro-batches' activations a rank of the ``zb`` body may hold at once, from
    ``F s.m`` to ``W s.m``: ``(V-1)·R + P`` (``R`` the first round's micro-batches), at most
    ``V·M``. With ``V = 1`` that is plain 1F1B's peak, ``P`` on rank 0 (ZB-H1's limit); it is
    below the interleaved body's rank-0 peak ``(V-1)·R + 2P - 1`` for every ``V``."""
    return min((vpp - 1) * _rounds(pp, micro)[0] + pp, vpp * micro)


def zero_bubble(pp: int, vpp: int, micro: int) -> list[list[int]]:
    """ZB-H1-style slots (``docs/schedule.md``, "Zero bubble"): the backward split into ``I`` and
    ``W``, the ``W`` steps placed in what would be bubbles, within :func:`zb_activation_limit`.

    A unit-time list schedule, all ranks slot by slot. Each rank keeps the interleaved body's
    forward sequence for its ``F`` steps and the mirrored sequence for its ``I`` steps, ``W``
    in ``I`` order. In each slot a rank runs its next ``I`` if that one's input is there, its next
    ``F`` if that one's input is there and the rank holds fewer activations than the limit —
    when both can run, the one it did not run last (1F1B's alternation, which keeps the
    forwards flowing to the ranks downstream while upstream gets its gradients) — otherwise
    its oldest pending ``W``, otherwise it idles.
    A slot where no rank can run anything while steps remain would repeat forever: that is
    raised as a ``ScheduleError`` (it does not happen for any ``P``, ``V``, ``M``: the limit lets
    micro-batch 0 reach the last stage, and every ``I`` frees a ``W``).
    """
    fwd, inp, f_need, i_need = _zb_sequences(pp, vpp, micro)
    limit = zb_activation_limit(pp, vpp, micro)
    total = micro * vpp
    w_of = codes.W - codes.I
    done: dict[int, int] = {}  # F and I codes -> the slot they ran in
    n_f, n_i, n_w = [0] * pp, [0] * pp, [0] * pp
    rows: list[list[int]] = [[] for _ in range(pp)]
    after_forward = [True] * pp  # whether the rank's last F or I was an F (the warm-up's are)
    slot = 0
    busy = list(range(pp))  # ranks with steps left
    while busy:
        ran = False
        for rank in busy:
            fi, ii, wi = n_f[rank], n_i[rank], n_w[rank]
            i_ready = ii < total and done.get(i_need[rank][ii], slot) < slot
            f_ready = False
            if fi < total and fi - wi < limit:  # room for one more micro-batch's activations
                need = f_need[rank][fi]
                f_ready = need is None or done.get(need, slot) < slot
            if i_ready and (not f_ready or after_forward[rank]):
                code = inp[rank][ii]
                done[code] = slot
                n_i[rank] = ii + 1
                after_forward[rank] = False
            elif f_ready:
                code = fwd[rank][fi]
                done[code] = slot
                n_f[rank] = fi + 1
                after_forward[rank] = True
            elif wi < ii:
                code = inp[rank][wi] + w_of
                n_w[rank] = wi + 1
            else:
                rows[rank].append(IDLE)
                continue
            rows[rank].append(code)
            ran = True
        if not ran:
            raise ScheduleError(f"zb body cannot be slotted for P={pp}, V={vpp}, M={micro}: every rank waits")
        busy = [rank for rank in busy if n_w[rank] < total]
        slot += 1
    return rows


def _zb_sequences(
    pp: int, vpp: int, micro: int
) -> tuple[list[list[int]], list[list[int]], list[list[int | None]], list[list[int]]]:
    """Each rank's ``F`` codes in the interleaved body's forward order, its ``I`` codes in the
    mirrored order, and what each of them waits for (see :func:`zero_bubble`)."""
    rounds = _rounds(pp, micro)
    chunk_of, micro_of = _op_sequence(rounds, vpp)
    last_stage = pp * vpp - 1
    unit, f_to_i = codes.STAGE_UNIT, codes.I - codes.F
    fwd = [
        [codes.F | (c * pp + rank) << STAGE_SHIFT | m for c, m in zip(chunk_of, micro_of, strict=True)]
        for rank in range(pp)
    ]
    inp = [
        [
            codes.I | ((vpp - 1 - c) * pp + rank) << STAGE_SHIFT | m
            for c, m in zip(chunk_of, micro_of, strict=True)
        ]
        for rank in range(pp)
    ]
    # What each F / I waits for: the step on the neighbouring stage (None: stage 0's F reads the
    # batch); the last stage's I waits for its own F, which its rank ran earlier.
    f_need = [[code - unit if code >= unit else None for code in row] for row in fwd]
    i_need = [
        [
            code - f_to_i if code >> STAGE_SHIFT & codes.FIELD_MASK == last_stage else code + unit
            for code in row
        ]
        for row in inp
    ]
    return fwd, inp, f_need, i_need


def one_f_one_b(pp: int, micro: int) -> list[list[int]]:
    """Plain (non-interleaved) 1F1B compute order: ``P-1-r`` warm-up forwards, then F/B pairs."""
    orders = []
    for rank in range(pp):
        fwd = [codes.F | rank << STAGE_SHIFT | m for m in range(micro)]
        bwd = [codes.B | rank << STAGE_SHIFT | m for m in range(micro)]
        warmup = min(pp - 1 - rank, micro)
        row = fwd[:warmup]
        for m in range(micro - warmup):
            row += (fwd[warmup + m], bwd[m])
        row += bwd[micro - warmup :]
        orders.append(row)
    return orders


def gpipe(pp: int, vpp: int, micro: int) -> list[list[int]]:
    """GPipe compute order: every forward, then every backward (chunk by chunk when V > 1)."""
    orders = []
    for rank in range(pp):
        stages = [c * pp + rank for c in range(vpp)]
        row = [codes.F | s << STAGE_SHIFT | m for s in stages for m in range(micro)]
        row += [codes.B | s << STAGE_SHIFT | m for s in reversed(stages) for m in range(micro)]
        orders.append(row)
    return orders


def forwards(pp: int, vpp: int, micro: int) -> list[list[int]]:
    """Forward-only compute order (evaluation): each rank's chunks in turn, every micro-batch of
    one chunk before the next chunk; with ``M >= P`` a chunk's first input arrives while the
    rank is still busy with its previous chunk, so no rank waits after the fill."""
    return [
        [codes.F | (c * pp + rank) << STAGE_SHIFT | m for c in range(vpp) for m in range(micro)]
        for rank in range(pp)
    ]


def _producer(code: int, last_stage: int) -> int | None:
    """The compute step on another stage whose result ``code`` consumes, if any."""
    stage = codes.stage_of(code)
    if codes.is_forward(code):
        return code - codes.STAGE_UNIT if stage > 0 else None
    if codes.is_weight_backward(code):
        return None  # W reads what its own rank's I kept
    return code + codes.STAGE_UNIT if stage < last_stage else None  # B or I: the next stage's


def unit_time_slots(pp: int, vpp: int, orders: list[list[int]]) -> list[list[int]]:
    """Slot each rank's compute order as if every step took one unit of time.

    A step starts one slot after the later of its rank's previous step and its producer on
    the neighbouring stage; the gaps become idle slots. Sweeping the ranks until nothing moves
    terminates because every producer comes earlier in some rank's order (the orders are
    deadlock free); a leftover step means they are not, which is a bug in the order.
    """
    last_stage = pp * vpp - 1
    slot_of: dict[int, int] = {}
    pos = [0] * pp
    rows: list[list[int]] = [[] for _ in range(pp)]
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            row = rows[rank]
            while pos[rank] < len(order):
                code = order[pos[rank]]
                start = len(row)
                producer = _producer(code, last_stage)
                if producer is not None:
                    done = slot_of.get(producer)
                    if done is None:
                        break
                    start = max(start, done + 1)
                row.extend([IDLE] * (start - len(row)))
                slot_of[code] = start
                row.append(code)
                pos[rank] += 1
                moved = True
    stuck = [r for r in range(pp) if pos[r] < len(orders[r])]
    if stuck:
        raise ScheduleError(f"compute order cannot be slotted: ranks {stuck} wait forever")
    return rows
