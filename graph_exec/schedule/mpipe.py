"""MPipe Transpose layering: the preprocess steps added around an unchanged body.

The rules are ``docs/schedule.md``, "MPipe layering".

The body is never reordered; MPipe only *inserts* steps: a prefix per rank (broadcast,
owned preprocess forwards, transfers to rank 0), rank 0's inline steps next to ``F 0.m`` /
``B 0.m``, and with owner backward a suffix (gradients back to the owners, one all-reduce).
That is what makes "strip the MPipe steps and you get the body" an invariant.

The functions take body rows with or without idle slots alike, so the same code produces the
executable orders and the orders ``with_idle`` (for display).
"""

from __future__ import annotations

from collections.abc import Sequence

from graph_exec.schedule import codes
from graph_exec.schedule.codes import is_stage0_forward, is_stage0_gradient_source, micro_of
from graph_exec.schedule.config import PlanConfig


def tbwd_micros(config: PlanConfig) -> frozenset[int]:
    """Micros whose preprocess gradient rank 0 computes with ``TBWD`` right after ``B 0.m``."""
    if not config.trainable or config.forward_only:
        return frozenset()
    if config.backward == "central":
        return frozenset(range(config.micro))
    return frozenset(config.owned(0))


def inline_micros(config: PlanConfig) -> frozenset[int]:
    """Micros rank 0 runs the preprocess forward of right before ``F 0.m``: the micros
    beyond ``NT`` with ``run_ahead="min"``, every micro without transposition (the fair baseline)."""
    if not config.transpose:
        return frozenset(range(config.micro))
    if config.run_ahead != "min":
        return frozenset()
    return frozenset(range(config.nt, config.micro))


def prefix(config: PlanConfig, rank: int) -> list[int]:
    """What ``rank`` runs before its body: BCAST, owned TFWDs, then transfers type-major."""
    row = [codes.BCAST] if config.broadcasts else []
    owned = config.owned(rank)
    inline = inline_micros(config)
    row += [codes.TFWD | m for m in owned if m not in inline]
    if rank == 0:
        others = [m for m in range(config.micro) if config.owner(m) != 0]
        row += [codes.OUTRECV | m for m in others]
        if config.ships_inputs:
            row += [codes.INRECV | m for m in others]
    else:
        row += [codes.OUTSEND | m for m in owned]
        if config.ships_inputs:
            row += [codes.INSEND | m for m in owned]
    return row


def suffix(config: PlanConfig, rank: int) -> list[int]:
    """Owner backward only: gradients shipped back to the owners, then the all-reduce.

    A suffix, not interleaved with the body, because each ship-back carries a blocking
    shape/dtype exchange that could deadlock against the body's own P2P traffic. A forward-only
    plan has no backward, hence no suffix.
    """
    if config.backward != "owner" or config.forward_only:
        return []
    if rank == 0:
        row = [codes.GRADSEND | m for m in range(config.micro) if config.owner(m) != 0]
    else:
        row = [codes.GRADRECV_BWD | m for m in config.owned(rank)]
    return [*row, codes.GRADREDUCE]


def patch_rank0(config: PlanConfig, row: Sequence[int]) -> Sequence[int]:
    """Rank 0's body with ``TFWD m`` before ``F 0.m`` (inline micros) and ``TBWD m`` after ``B 0.m``
    (``I 0.m`` with the split backward: the preprocess backward needs stage 0's input gradient only,
    not its weight gradients)."""
    inline = inline_micros(config)
    tbwd = tbwd_micros(config)
    if not inline and not tbwd:
        return row
    out: list[int] = []
    append = out.append
    for code in row:
        if is_stage0_forward(code) and micro_of(code) in inline:
            append(codes.TFWD | micro_of(code))
        append(code)
        if is_stage0_gradient_source(code) and micro_of(code) in tbwd:  # B 0.m, or I 0.m (zb)
            append(codes.TBWD | micro_of(code))
    return out


def layer(config: PlanConfig, body: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
    """Every rank's full order: prefix + body (rank 0 patched) + suffix."""
    if not config.mpipe:
        return body
    rows = []
    for rank, row in enumerate(body):
        middle = patch_rank0(config, row) if rank == 0 else row
        rows.append([*prefix(config, rank), *middle, *suffix(config, rank)])
    return rows
