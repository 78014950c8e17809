"""``docs/schedule.md``, "Invariants", on a sampled grid of configurations, checked
independently of the validator.

``build_plan`` validates every plan itself; these checks are written separately, on ``Step``
objects and the public ``Plan`` API, so a bug in the validator cannot hide a bug in a builder.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from graph_exec.schedule import Plan, PlanConfig, PlanConfigError, Step, StepKind, build_plan, to_text
from graph_exec.schedule.steps import BODY_KINDS, MPIPE_KINDS, RECV_KINDS, SEND_KINDS

K = StepKind
OPTIONS = list(
    itertools.product(
        ("trainable", "frozen", "none"), ("full", "min"), ("central", "owner"), ("replicated", "owned")
    )
)


def _valid(pp: int, vpp: int, micro: int, options: tuple[str, str, str, str], body: str) -> PlanConfig | None:
    preprocess, run_ahead, backward, input_ = options
    try:
        return PlanConfig(pp, vpp, micro, preprocess, None, run_ahead, backward, input_, body)
    except PlanConfigError:
        return None


ALL = [
    config
    for pp in range(1, 9)
    for vpp in range(1, 5)
    for micro in range(1, 3 * pp + 1)
    for options in OPTIONS
    for body in ("interleaved", "1f1b", "gpipe")
    if (config := _valid(pp, vpp, micro, options, body)) is not None
]
# Every single-rank configuration (they are few, so a plain sample would miss them) plus a
# fixed-seed sample of the rest.
GRID = [c for c in ALL if c.pp == 1] + random.Random(20240601).sample([c for c in ALL if c.pp > 1], 650)


def test_the_sample_covers_every_valid_option_combination() -> None:
    def combo(c: PlanConfig) -> tuple[str, ...]:
        return (c.preprocess, c.run_ahead, c.backward, c.input, c.body)

    assert len(GRID) >= 500
    assert {combo(c) for c in GRID} == {combo(c) for c in ALL}
    assert {c.pp for c in GRID} == set(range(1, 9)) and {c.vpp for c in GRID} == {1, 2, 3, 4}


def _message(step: Step) -> tuple:
    """What a send or receive carries, named the same on both ends."""
    kind, stage, micro = step.kind, step.stage, step.micro
    if kind in (K.FSEND, K.FRECV):
        return ("F", stage if kind == K.FSEND else stage - 1, micro)
    if kind in (K.BSEND, K.BRECV):
        return ("B", stage if kind == K.BSEND else stage + 1, micro)
    return (kind.value.replace("send", "").replace("recv", "").replace("+bwd", ""), micro)


def _rendezvous_completes(plan: Plan) -> bool:
    """Naive blocking replay: a transfer moves only when both ends are at it."""
    orders = plan.orders
    pos = [0] * len(orders)

    def head(rank: int) -> Step | None:
        return orders[rank][pos[rank]] if pos[rank] < len(orders[rank]) else None

    moved = True
    while moved:
        moved = False
        for rank in range(len(orders)):
            while (step := head(rank)) is not None:
                if step.kind in SEND_KINDS or step.kind in RECV_KINDS:
                    peer = plan.peer(rank, step)
                    other = head(peer)
                    if other is None or other.kind not in SEND_KINDS | RECV_KINDS:
                        break
                    opposite = (step.kind in SEND_KINDS) != (other.kind in SEND_KINDS)
                    if not (
                        opposite and plan.peer(peer, other) == rank and _message(other) == _message(step)
                    ):
                        break
                    pos[peer] += 1
                elif step.kind in (K.BCAST, K.GRADREDUCE):
                    if any(head(r) != step for r in range(len(orders))):
                        break
                    for r in range(len(orders)):
                        if r != rank:
                            pos[r] += 1
                pos[rank] += 1
                moved = True
    return all(head(rank) is None for rank in range(len(orders)))


def _check_invariants(plan: Plan) -> None:
    cfg = plan.config
    orders = plan.orders
    body_only = replace(
        cfg, preprocess="none", num_preprocess_layers=None, backward="central", input="replicated"
    )
    assert [tuple(s for s in row if s.kind in BODY_KINDS) for row in orders] == list(
        build_plan(body_only).orders
    )
    assert not any(s.kind == K.IDLE for row in orders for s in row)
    assert [tuple(s for s in row if s.kind != K.IDLE) for row in plan.with_idle] == list(orders)

    # coverage: every F and B exactly once, on the rank of its stage
    for kind in (K.F, K.B):
        found = [(s.stage, s.micro, rank) for rank, row in enumerate(orders) for s in row if s.kind == kind]
        assert sorted(found) == [
            (s, m, s % cfg.pp) for s in range(cfg.pp * cfg.vpp) for m in range(cfg.micro)
        ]

    # one BCAST per rank or none; no step twice on a rank
    for row in orders:
        assert sum(s.kind == K.BCAST for s in row) == (cfg.preprocess == "trainable" and cfg.pp > 1)
        assert len(set(row)) == len(row)

    # per message type and rank pair: sends and receives pair one-to-one, in the same order
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, row in enumerate(orders):
        for step in row:
            if step.kind in SEND_KINDS:
                sent.setdefault((rank, plan.peer(rank, step)), []).append(_message(step))
            elif step.kind in RECV_KINDS:
                received.setdefault((plan.peer(rank, step), rank), []).append(_message(step))
    assert sent == received

    assert _rendezvous_completes(plan)

    # data arrives before it is used
    for row in orders:
        index = {step: i for i, step in enumerate(row)}
        for step, i in index.items():
            if step.kind == K.F and step.stage > 0 and cfg.pp > 1:
                assert index[Step(K.FRECV, step.stage, step.micro)] < i
            if step.kind == K.B and step.stage < plan.last_stage and cfg.pp > 1:
                assert index[Step(K.BRECV, step.stage, step.micro)] < i
            if step.kind == K.F and step.stage == 0 and cfg.mpipe:
                source = K.TFWD if plan.owner(step.micro) == 0 else K.OUTRECV
                assert index[Step(source, None, step.micro)] < i

    # rank 0's inline MPipe steps sit right next to the body steps they belong to
    row0 = orders[0]
    for i, step in enumerate(row0):
        if step.kind == K.TBWD:
            assert row0[i - 1] == Step(K.B, 0, step.micro)
        if step.kind == K.TFWD and cfg.run_ahead == "min" and step.micro >= cfg.nt:
            assert row0[i + 1] == Step(K.F, 0, step.micro)
    if cfg.trainable and cfg.backward == "central":
        assert sum(s.kind == K.TBWD for s in row0) == cfg.micro
    if cfg.backward == "owner":
        assert all(row[-1].kind == K.GRADREDUCE for row in orders)
    if not cfg.mpipe:
        assert not any(s.kind in MPIPE_KINDS for row in orders for s in row)


@pytest.mark.parametrize("chunk", range(7))
def test_invariants_on_the_grid(chunk: int) -> None:
    for config in GRID[chunk::7]:
        _check_invariants(build_plan(config))


def test_full_equals_min_when_every_micro_has_its_own_owner() -> None:
    compared = 0
    for config in ALL:
        if config.run_ahead == "full" and config.micro <= config.nt and config.body == "interleaved":
            full = build_plan(config)
            assert to_text(build_plan(replace(config, run_ahead="min"))) == to_text(full)
            compared += 1
    assert compared > 500


def test_full_and_min_differ_once_micros_exceed_nt() -> None:
    config = PlanConfig(pp=2, micro=3, preprocess="frozen")
    assert to_text(build_plan(config)) != to_text(build_plan(replace(config, run_ahead="min")))
