"""Sequence packing: which samples share a row, and which rows make a micro-batch.

A padded batch pads every sample to its longest; with long-tailed conversation lengths most of
it is padding. :func:`pack` puts several samples into each row of at most ``max_length`` tokens
(the chunks then keep each sample to itself: segment ids in the attention mask, positions
restarting per sample, see ``docs/models.md`` "Packing"), and deals the rows into ``micro``
micro-batches. It sees two costs per sample: its tokens (the decoder's work, bounded per row by
``max_length``) and its image patches (the tower's work, summed per micro-batch: what
``tower_order="balanced"`` places by). Packing by tokens alone can put every large image in one
micro-batch; ``balance="tower"`` spreads the images first (largest first, each to the
micro-batch with the least tower cost where it still fits) and then fills with text.

A packed micro-batch's tower runs ``pixel_values [rows, P, dim]`` with ``P`` its fullest row's
patches, so what it computes is rows × the most patches of a row (:meth:`Packing.tower_work`),
not the sum of real patches (:meth:`Packing.tower_costs`). ``balance="tower"`` therefore also
evens the patches across the rows (a heavy image leaves a row it shares with another for a
light row with room, no row added) and swaps samples between micro-batches while that lowers
the most tower work of a micro-batch, and chooses between its candidate packings by that work.

The rows per micro-batch are the same in every micro-batch of a step (one input shape): fixed
(``rows=R``), the fewest this packing needs, or that rounded up to a bucket of ``row_buckets``
(:func:`row_buckets_upto`: 1, 2, 3, 4, 6, 8, ...); or, with ``ragged=True`` (for
``run(micro_batches=...)``, which takes micro-batches of different row counts), each micro-batch
keeps the rows it holds (or its own bucket): the rows are then filled best fit over the whole
batch and dealt whole, so only about one row of the batch is part empty, not one per micro-batch
plus every micro-batch padded to the fullest one's count. Buckets keep both the packed rows' padding and
the number of shapes a run meets low: in graph mode every new shape compiles graphs whose
memory the process keeps, and a fixed ``rows`` large enough for every step leaves most rows empty.

Pure Python and numpy, decided on the host from the sizes alone and deterministically from
``seed`` (ties broken by a seeded permutation): every rank that holds the same samples computes
the same packing without communicating; a data-parallel replica packs its own shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

BALANCES = ("tower", "tokens")
#: Tower work max/mean that counts as even when ``ragged=True`` weighs fewer rows against balance.
EVEN = 1.1


class SampleCost(NamedTuple):
    """What packing needs to know of one sample."""

    tokens: int  #: its length (text and image tokens)
    patches: int = 0  #: its images' patches (the tower's work)
    image_tokens: int = 0  #: the tokens its images need in its row (image tokens and frames)


class Packing(NamedTuple):
    """``micro_batches[m][r]``: the indices of the samples of row ``r`` of micro-batch ``m``, in
    the order they sit in the row (an empty row is all padding). Every micro-batch has the same
    number of rows (one shape), unless packed with ``ragged=True``."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def rows(self) -> int:
        """Rows per micro-batch (ragged: the most any micro-batch has)."""
        return max(len(mb) for mb in self.micro_batches)

    @property
    def row_counts(self) -> list[int]:
        """Each micro-batch's rows."""
        return [len(mb) for mb in self.micro_batches]

    def tower_costs(self, costs: Sequence[SampleCost]) -> list[float]:
        """Each micro-batch's patches: its tower's work (``vlm_tower_costs`` scale)."""
        return [float(sum(costs[i].patches for row in mb for i in row)) for mb in self.micro_batches]

    def tower_work(self, costs: Sequence[SampleCost]) -> list[float]:
        """Each micro-batch's tower work as its layout computes it: rows × the most patches of
        any of its rows (``pixel_values [rows, P, dim]``, every row padded to the fullest one's
        patches; the patch bucket left out). Empty rows count: the tower runs them too. This,
        not :meth:`tower_costs`, is what a packed micro-batch's tower time follows."""
        return [float(_work(mb, costs)) for mb in self.micro_batches]

    def with_rows(self, rows: int) -> Packing:
        """The same packing with every micro-batch padded with empty rows to ``rows`` (what
        ``pack(..., rows=rows)`` gives for the same samples and seed, without packing again)."""
        if rows < self.rows:
            raise ValueError(f"rows={rows} is below the {self.rows} rows this packing needs")
        return Packing(tuple(mb + ((),) * (rows - len(mb)) for mb in self.micro_batches))

    def padding_fraction(self, costs: Sequence[SampleCost], max_length: int) -> float:
        """The share of the micro-batches' ``rows × max_length`` token slots that hold padding."""
        real = sum(costs[i].tokens for mb in self.micro_batches for row in mb for i in row)
        return 1.0 - real / (sum(self.row_counts) * max_length)


def spread(values: Sequence[float]) -> float:
    """``max / mean`` of ``values`` (1.0 is perfectly even; 1.0 for all zeros)."""
    mean = float(np.mean(values)) if len(values) else 0.0
    return float(max(values)) / mean if mean > 0 else 1.0


def check_budget(costs: Sequence[SampleCost], max_length: int) -> None:
    """Every sample fits one row of ``max_length`` tokens.

    Raises ``ValueError``: a budget below some sample's image tokens names the smallest budget
    that holds every sample's images (cutting cannot help there); a sample longer than the
    budget is named with its length."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int (tokens per packed row), got {max_length!r}")
    need = max((c.image_tokens for c in costs), default=0)
    if need > max_length:
        k = max(range(len(costs)), key=lambda i: costs[i].image_tokens)
        raise ValueError(
            f"max_length {max_length} is below the {need} tokens of sample {k}'s images: the smallest "
            f"max_length that holds every sample's images is {need}"
        )
    for k, cost in enumerate(costs):
        if cost.tokens > max_length:
            raise ValueError(
                f"sample {k} has {cost.tokens} tokens, above max_length {max_length}: cut it "
                f"(ConversationDataset(..., max_length={max_length}, truncate=True)), skip it, or raise max_length"
            )


def pack(
    costs: Sequence[SampleCost],
    max_length: int,
    micro: int,
    *,
    balance: str = "tower",
    seed: int = 0,
    rows: int | None = None,
    row_buckets: Sequence[int] | None = None,
    ragged: bool = False,
) -> Packing:
    """Pack samples of ``costs`` into rows of at most ``max_length`` tokens, in ``micro``
    micro-batches of equal row counts: ``rows`` each (so every step has the same shapes and
    nothing compiles per step), the fewest this strategy needs rounded up to the smallest of
    ``row_buckets`` that holds them (few shapes, little padding), or the fewest (both ``None``).

    ``balance="tower"``: samples by patches (largest first), each to the micro-batch with the
    least tower cost so far (text-only samples: the fewest tokens), best-fit into its rows; or,
    where that needs more rows, the rows of token-only packing dealt heaviest first (whichever
    has fewer rows per micro-batch, then the smaller spread of tower work, then of real
    patches), each with its rows' patches evened and samples swapped between micro-batches
    (:func:`_even_swaps`).
    ``balance="tokens"``: rows filled best-fit by tokens alone (largest first), dealt to the
    micro-batches in consecutive groups (the baseline balanced rows are measured against).

    ``ragged=True`` (not with ``rows``): each micro-batch keeps its own row count (at least one;
    with ``row_buckets``, its own bucket), for ``run(micro_batches=...)``. The rows are filled
    best fit over the whole batch and dealt whole, ``⌊N/M⌋`` or ``⌈N/M⌉`` to each micro-batch
    (the body's work stays even; fewer rows than micro-batches are spread one per micro-batch,
    so none runs a row without a sample where there are enough samples); ``"tower"`` deals them
    heaviest tower first to the lightest micro-batch, then swaps samples between micro-batches'
    rows while that evens the tower costs (keeping the sample-dealt packing instead where it has
    as few rows and a smaller spread of tower work).
    """
    buckets = _checked_arguments(costs, max_length, micro, balance, rows, row_buckets, ragged)
    tie = np.random.default_rng(seed).permutation(len(costs))
    by_tokens = sorted(range(len(costs)), key=lambda i: (-costs[i].tokens, tie[i]))
    what = f"{len(costs)} samples"
    if ragged:

        def width(need: int) -> int:
            return max(1, need) if buckets is None else row_bucket(max(1, need), buckets, what)

        groups = _ragged_groups(by_tokens, costs, max_length, micro, balance, tie, width)
        return Packing(tuple(tuple(tuple(r) for r in g) + ((),) * (width(len(g)) - len(g)) for g in groups))
    groups = _even_groups(by_tokens, costs, max_length, micro, balance, tie)
    need = max(1, max(len(g) for g in groups))
    if rows is not None and need > rows:
        raise ValueError(
            f"{len(costs)} samples of {sum(c.tokens for c in costs)} tokens need {need} rows of max_length "
            f"{max_length} in some micro-batch, above rows={rows}: raise rows or max_length, or pass fewer samples"
        )
    width = rows or (need if buckets is None else row_bucket(need, buckets, what))
    return Packing(tuple(tuple(tuple(r) for r in g) + ((),) * (width - len(g)) for g in groups))


def _checked_arguments(
    costs: Sequence[SampleCost],
    max_length: int,
    micro: int,
    balance: str,
    rows: int | None,
    row_buckets: Sequence[int] | None,
    ragged: bool,
) -> tuple[int, ...] | None:
    """:func:`pack`'s arguments checked (each bad value named with what is allowed); the row
    buckets, checked, or ``None``."""
    buckets = checked_options(micro, balance, rows, row_buckets, ragged)
    if not costs:
        raise ValueError("nothing to pack: no samples")
    check_budget(costs, max_length)
    return buckets


def checked_options(
    micro: int, balance: str, rows: int | None, row_buckets: Sequence[int] | None, ragged: bool
) -> tuple[int, ...] | None:
    """:func:`pack`'s options that do not depend on the samples, checked (each bad value named
    with what is allowed), so a collate can refuse them before the first batch; the row
    buckets, checked, or ``None``."""
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"micro must be a positive int (the number of micro-batches), got {micro!r}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be a positive int (rows per micro-batch) or None, got {rows!r}")
    if rows is not None and row_buckets is not None:
        raise ValueError(f"give rows={rows!r} or row_buckets={row_buckets!r}, not both")
    if rows is not None and ragged:
        raise ValueError(
            f"give rows={rows!r} (every micro-batch that many) or ragged=True (each its own), not both"
        )
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}; choose one of {BALANCES}")
    return None if row_buckets is None else checked_row_buckets(row_buckets)


def _even_groups(
    by_tokens: list[int],
    costs: Sequence[SampleCost],
    max_length: int,
    micro: int,
    balance: str,
    tie: np.ndarray,
) -> list[list[list[int]]]:
    """The micro-batches' rows of :func:`pack` without ``ragged`` (each padded to the fullest's
    count afterwards)."""
    if balance == "tokens":
        filled = _fill_rows(by_tokens, costs, max_length)
        size = -(-len(filled) // micro)
        return [filled[m * size : (m + 1) * size] for m in range(micro)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i].patches, -costs[i].tokens, tie[i]))
    candidates = (
        _even_swaps(_balanced(order, costs, max_length, micro), costs, max_length),
        _even_swaps(_rows_balanced(by_tokens, costs, max_length, micro), costs, max_length),
    )
    return min(
        candidates,
        key=lambda g: (max(len(rows) for rows in g), _work_spread(g, costs), _tower_spread(g, costs)),
    )


def _ragged_groups(
    by_tokens: Sequence[int],
    costs: Sequence[SampleCost],
    max_length: int,
    micro: int,
    balance: str,
    tie: np.ndarray,
    width: Callable[[int], int],
) -> list[list[list[int]]]:
    """The micro-batches' rows for ``ragged=True``: the batch's best-fit rows dealt whole (in
    consecutive runs for ``"tokens"``; for ``"tower"`` by tower cost and then evened by swaps).
    ``"tower"`` keeps the sample-dealt rows of :func:`_balanced` instead where those fill fewer
    row slots (``width`` of each micro-batch's rows) at a tower work spread within
    :data:`EVEN` or the better one's, or the dealt rows are spread beyond both: fewer rows never
    cost balance. The batch's rows have their patches evened (:func:`_even_rows`) before they
    are dealt."""
    filled = _fill_rows(by_tokens, costs, max_length)
    if len(filled) < micro:  # every micro-batch takes a row anyway: one with no sample is waste
        filled = _spread_rows(by_tokens, costs, max_length, min(micro, len(costs))) or filled
    if balance == "tokens":
        edges = [len(filled) * m // micro for m in range(micro + 1)]
        return [filled[edges[m] : edges[m + 1]] for m in range(micro)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i].patches, -costs[i].tokens, tie[i]))
    candidates = (
        _even_swaps(_rows_dealt(_even_rows(filled, costs, max_length), costs, micro), costs, max_length),
        _even_swaps(_balanced(order, costs, max_length, micro), costs, max_length),
    )
    spreads = [_work_spread(g, costs) for g in candidates]
    even = max(EVEN, min(spreads))
    best = min(
        range(len(candidates)),
        key=lambda k: (spreads[k] > even, sum(width(len(g)) for g in candidates[k]), spreads[k]),
    )
    return candidates[best]


def _rows_dealt(filled: list[list[int]], costs: Sequence[SampleCost], micro: int) -> list[list[list[int]]]:
    """``filled`` dealt heaviest tower first to the lightest micro-batch that may take another
    row: ``⌊N/M⌋`` rows each and one more for ``N mod M`` of them. The heaviest row of each
    micro-batch is its first (one each, heaviest first), and the extra rows go to the
    micro-batches whose heaviest row is lightest: a micro-batch's tower work is its rows × its
    fullest row's patches (:func:`_work`)."""
    floor, extra = divmod(len(filled), micro)
    quota = [floor + (m >= micro - extra) for m in range(micro)]
    weight = [sum(costs[i].patches for i in row) for row in filled]
    groups: list[list[list[int]]] = [[] for _ in range(micro)]
    patches = [0] * micro
    for r in sorted(
        range(len(filled)), key=lambda r: (-weight[r], -sum(costs[i].tokens for i in filled[r]), r)
    ):
        room = [m for m in range(micro) if len(groups[m]) < quota[m]]
        m = min(room, key=lambda m: (bool(groups[m]), patches[m], quota[m], m))
        groups[m].append(filled[r])
        patches[m] += weight[r]
    return groups


def _even_swaps(
    groups: list[list[list[int]]], costs: Sequence[SampleCost], max_length: int
) -> list[list[list[int]]]:
    """Swap a sample of the micro-batch with the most tower work (or the most real patches) with
    one of another micro-batch's rows (each row still within ``max_length``, no row emptied)
    while a swap lowers the most tower work of any micro-batch (:func:`_work`: rows × the
    fullest row's patches, what the layout computes), or keeps it and lowers the sum of squared
    real patches, the best swap first: the rows and their count stay, the towers even out. That
    key only falls, so the swaps end; only the heaviest micro-batches' samples are tried. Each
    micro-batch's rows are evened (:func:`_even_rows`) before and after."""
    groups = [_even_rows(g, costs, max_length) for g in groups]
    where = {i: (m, r) for m, g in enumerate(groups) for r, row in enumerate(g) for i in row}
    used = [[sum(costs[i].tokens for i in row) for row in g] for g in groups]
    loads = [[sum(costs[i].patches for i in row) for row in g] for g in groups]
    for _ in range(4 * len(where)):
        works = [_load_work(load) for load in loads]
        reals = [sum(load) for load in loads]
        ranked = sorted(range(len(groups)), key=lambda m: -works[m])
        heavy = {ranked[0], reals.index(max(reals))}
        best, swap = (works[ranked[0]], 0), None
        for i, (a, ra) in where.items():
            if a not in heavy:
                continue
            rest_a = [x for k, x in enumerate(loads[a]) if k != ra]
            for j, (b, rb) in where.items():
                moved = costs[i].patches - costs[j].patches
                if a == b or moved <= 0 or (works[a] <= works[b] and moved >= reals[a] - reals[b]):
                    continue  # neither the slower tower nor the real patches would even out
                grow = costs[j].tokens - costs[i].tokens
                if used[a][ra] + grow > max_length or used[b][rb] - grow > max_length:
                    continue
                rest = next((works[m] for m in ranked if m not in (a, b)), 0)
                work_a = len(loads[a]) * max(max(rest_a, default=0), loads[a][ra] - moved)
                work_b = len(loads[b]) * max(max(loads[b]), loads[b][rb] + moved)
                squares = 2 * moved * (moved - reals[a] + reals[b])  # the change of the sum of squares
                key = (max(rest, work_a, work_b), squares)
                if key < best:
                    best, swap = key, (i, j)
        if swap is None:
            break
        i, j = swap
        (a, ra), (b, rb) = where[i], where[j]
        groups[a][ra][groups[a][ra].index(i)] = j
        groups[b][rb][groups[b][rb].index(j)] = i
        grow = costs[j].tokens - costs[i].tokens
        used[a][ra] += grow
        used[b][rb] -= grow
        moved = costs[i].patches - costs[j].patches
        loads[a][ra] -= moved
        loads[b][rb] += moved
        where[i], where[j] = (b, rb), (a, ra)
    return [_even_rows(g, costs, max_length) for g in groups]


def _load_work(load: Sequence[int]) -> int:
    """:func:`_work` of a micro-batch's rows' patches."""
    return len(load) * max(load, default=0)


def _even_rows(group: list[list[int]], costs: Sequence[SampleCost], max_length: int) -> list[list[int]]:
    """One micro-batch's rows with their patches evened: move a sample out of a fullest row (by
    patches) to another row, or swap it with a lighter sample of another row (each row within
    ``max_length``, no row emptied, no row added), while that lowers the most patches of a row
    (what every row of the micro-batch is padded to), or keeps it and lowers the two rows' sum
    of squares. A heavy image's sample then leaves a row it shares with another heavy one for a
    light row with room. Only moves out of the fullest rows are tried: a pass is
    O(samples × rows), not O(samples²)."""
    rows = [list(row) for row in group]
    used = [sum(costs[i].tokens for i in row) for row in rows]
    load = [sum(costs[i].patches for i in row) for row in rows]
    for _ in range(4 * sum(map(len, rows))):
        top = max(load, default=0)
        ranked = sorted(range(len(rows)), key=lambda k: -load[k])
        best, step = (top, 0), None
        for r in (k for k in range(len(rows)) if load[k] == top):
            for s in range(len(rows)):
                rest = next((load[k] for k in ranked if k not in (r, s)), 0)
                for i in rows[r] if s != r else ():
                    for j in [None, *rows[s]]:
                        moved = costs[i].patches - (0 if j is None else costs[j].patches)
                        grow = costs[i].tokens - (0 if j is None else costs[j].tokens)
                        if moved <= 0 or max(used[s] + grow, used[r] - grow) > max_length:
                            continue
                        if j is None and len(rows[r]) == 1:
                            continue
                        lr, ls = load[r] - moved, load[s] + moved
                        key = (max(rest, lr, ls), lr * lr + ls * ls - load[r] ** 2 - load[s] ** 2)
                        if key < best:
                            best, step = key, (r, s, i, j)
        if step is None:
            break
        r, s, i, j = step
        rows[r].remove(i)
        rows[s].append(i)
        if j is not None:
            rows[s].remove(j)
            rows[r].append(j)
        for k in (r, s):
            used[k] = sum(costs[x].tokens for x in rows[k])
            load[k] = sum(costs[x].patches for x in rows[k])
    return rows


def _work(group: Sequence[Sequence[int]], costs: Sequence[SampleCost]) -> int:
    """Rows × the most patches of any row: the patches a packed micro-batch's tower computes."""
    return _load_work([sum(costs[i].patches for i in row) for row in group])


def _work_spread(groups: Sequence[Sequence[Sequence[int]]], costs: Sequence[SampleCost]) -> float:
    return spread([float(_work(g, costs)) for g in groups])


def checked_row_buckets(row_buckets: Sequence[int]) -> tuple[int, ...]:
    """``row_buckets`` as a tuple, if it is a non-empty increasing sequence of positive ints."""
    buckets = tuple(row_buckets) if isinstance(row_buckets, (tuple, list)) else None
    if (
        not buckets
        or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in buckets)
        or any(a >= b for a, b in itertools.pairwise(buckets))
    ):
        raise ValueError(
            f"row_buckets={row_buckets!r}: a non-empty increasing tuple of positive ints (rows per "
            "micro-batch), e.g. (1, 2, 3, 4, 6, 8) or row_buckets_upto(n)"
        )
    return tuple(int(b) for b in buckets)


def row_bucket(need: int, row_buckets: Sequence[int], what: str = "the samples") -> int:
    """The smallest of ``row_buckets`` (increasing) that is at least ``need`` rows.

    Raises ``ValueError`` naming ``what`` needs more rows than the largest bucket."""
    for bucket in row_buckets:
        if bucket >= need:
            return bucket
    raise ValueError(
        f"{what} need {need} rows in some micro-batch, above the largest of row_buckets="
        f"{tuple(row_buckets)}: add a bucket of at least {need}, or raise max_length"
    )


def row_buckets_upto(most: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: powers of two and 1.5 times them, up to the first at least
    ``most``. A row count is rounded up by less than half (packed padding stays low) and a run
    meets about ``2 log2(most)`` row shapes at most."""
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ValueError(f"most must be a positive int (rows per micro-batch), got {most!r}")
    buckets, power = [1], 2
    while buckets[-1] < most:
        buckets += [b for b in (power, power * 3 // 2) if b > buckets[-1]]
        power *= 2
    return tuple(b for k, b in enumerate(buckets) if k == 0 or buckets[k - 1] < most)


def _fill_rows(order: Sequence[int], costs: Sequence[SampleCost], max_length: int) -> list[list[int]]:
    """Best fit: each sample into the fullest row that still holds it, else a new row."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in order:
        _place(i, costs[i].tokens, rows, used, max_length)
    return rows


def _spread_rows(
    order: Sequence[int], costs: Sequence[SampleCost], max_length: int, count: int
) -> list[list[int]] | None:
    """``count`` rows, each sample (largest first) into the one with the fewest tokens: as many
    rows with work as the micro-batches that will hold one row each; ``None`` where a sample
    does not fit the row it goes to (best fit then keeps its fewer rows)."""
    rows: list[list[int]] = [[] for _ in range(count)]
    used = [0] * count
    for i in order:
        r = min(range(count), key=lambda r: (used[r], r))
        if used[r] + costs[i].tokens > max_length:
            return None
        rows[r].append(i)
        used[r] += costs[i].tokens
    return rows


def _place(i: int, tokens: int, rows: list[list[int]], used: list[int], max_length: int) -> None:
    fits = [r for r in range(len(rows)) if used[r] + tokens <= max_length]
    if fits:
        r = max(fits, key=lambda r: (used[r], -r))
        rows[r].append(i)
        used[r] += tokens
    else:
        rows.append([i])
        used.append(tokens)


def _balanced(
    order: Sequence[int], costs: Sequence[SampleCost], max_length: int, micro: int
) -> list[list[list[int]]]:
    """Samples dealt largest-tower-first to the lightest micro-batch (by patches, then by
    tokens) among those that hold it within ``limit`` rows, each micro-batch filling its own
    rows best fit. ``limit`` starts at the rows token-only packing needs per micro-batch and
    grows only when no micro-batch holds the sample: the rows stay as few as by tokens alone
    (every micro-batch is padded to the fullest one's row count)."""
    limit = -(-len(_fill_rows(order, costs, max_length)) // micro)
    rows: list[list[list[int]]] = [[] for _ in range(micro)]
    used: list[list[int]] = [[] for _ in range(micro)]
    patches = [0] * micro
    tokens = [0] * micro
    for i in order:
        cost = costs[i]
        holds = [m for m in range(micro) if _rows_after(used[m], cost.tokens, max_length) <= limit]
        if not holds:
            limit += 1
            holds = list(range(micro))
        m = min(holds, key=lambda m: (patches[m], tokens[m], m) if cost.patches else (tokens[m], m))
        _place(i, cost.tokens, rows[m], used[m], max_length)
        patches[m] += cost.patches
        tokens[m] += cost.tokens
    return rows


def _rows_balanced(
    order: Sequence[int], costs: Sequence[SampleCost], max_length: int, micro: int
) -> list[list[list[int]]]:
    """The rows of token-only packing (as few as it gets), dealt as :func:`_rows_dealt` deals
    them: balanced at row granularity, no more rows than by tokens alone (the fallback when
    dealing samples needs more rows). The rows' patches are evened first
    (:func:`_even_rows`), so heavy images do not share a row."""
    return _rows_dealt(_even_rows(_fill_rows(order, costs, max_length), costs, max_length), costs, micro)


def _tower_spread(groups: Sequence[Sequence[Sequence[int]]], costs: Sequence[SampleCost]) -> float:
    return spread([float(sum(costs[i].patches for row in g for i in row)) for g in groups])


def _rows_after(used: Sequence[int], tokens: int, max_length: int) -> int:
    """The rows a micro-batch holds after taking ``tokens`` more (so text fills rows already
    open before it opens new ones)."""
    return len(used) + (0 if any(u + tokens <= max_length for u in used) else 1)
