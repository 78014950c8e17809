"""The zero-bubble body (``body="zb"``): the split backward ``I`` + ``W``, its plans under every MPipe
option, the validator's rules for ``I`` and ``W``, its memory, and its order against torch's rules
and torch's ``ScheduleInterleavedZeroBubble`` construction (``docs/schedule.md``, "Zero bubble")."""

from __future__ import annotations

import csv
import io
import itertools
import re

import pytest

from graph_exec.schedule import (
    CoverageError,
    DependencyError,
    InvariantError,
    Plan,
    PlanConfig,
    Step,
    StepKind,
    build_plan,
    codes,
    to_csv,
    to_text,
)
from graph_exec.schedule.body import _rounds, unit_time_slots, zb_activation_limit
from graph_exec.schedule.memory import ItemSizes, held_items, peak_bytes, peak_counts
from graph_exec.schedule.p2p import insert_p2p
from graph_exec.schedule.validate import validate


def _rows(plan: Plan) -> list[list[str]]:
    return [line.split(": ", 1)[1].split() for line in to_text(plan).splitlines()]


def test_i_and_w_tokens_round_trip() -> None:
    for token, kind in (("I3.2", StepKind.I), ("W0.0", StepKind.W), ("INsend1", StepKind.INSEND)):
        step = Step.parse(token)
        assert step.kind is kind and step.token == token
        assert codes.decode(codes.encode_step(step)) == step


def test_the_other_bodies_have_no_i_or_w() -> None:
    for body in ("interleaved", "1f1b", "gpipe"):
        plan = build_plan(PlanConfig(pp=4, micro=8, body=body, preprocess="trainable"))
        assert not plan.config.split_backward
        assert not any(s.kind in (StepKind.I, StepKind.W) for row in plan.orders for s in row)


_OPTIONS = [
    {},
    {"preprocess": "frozen"},
    {"preprocess": "trainable"},
    {"preprocess": "trainable", "run_ahead": "min"},
    {"preprocess": "trainable", "backward": "owner"},
    {"preprocess": "trainable", "run_ahead": "min", "input": "owned"},
    {"preprocess": "trainable", "transpose": False},
    {"preprocess": "none", "input": "owned"},
]


@pytest.mark.parametrize(
    "options", _OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "body"
)
def test_zb_plans_build_and_validate_under_every_mpipe_option(options: dict) -> None:
    """Every P, V and M builds (no configuration is refused), and the MPipe layering sits on
    stage 0's input gradient: ``TBWD m`` right after ``I 0.m``, ``GRADsend m`` after it."""
    built = 0
    for pp, vpp in itertools.product((1, 2, 3, 4), (1, 2, 3)):
        if pp == 1 and (options.get("backward") == "owner" or options.get("input") == "owned"):
            continue
        for micro in sorted({1, 2, pp, pp + 1, 2 * pp, 2 * pp + 1}):
            plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, body="zb", **options))
            built += 1
            row0 = [s.token for s in plan.orders[0]]
            for i, token in enumerate(row0):
                if token.startswith("TBWD"):
                    assert row0[i - 1] == f"I0.{token[4:]}"
                if token.startswith("GRADsend"):
                    assert row0.index(f"I0.{token[8:]}") < i
            for row in plan.orders:
                tokens = [s.token for s in row]
                for step in row:
                    if step.kind is StepKind.W:  # W after I after F, all on the stage's rank
                        i = tokens.index(f"I{step.stage}.{step.micro}")
                        assert tokens.index(f"F{step.stage}.{step.micro}") < i < tokens.index(step.token)
                    if step.kind is StepKind.BSEND:  # the input gradient ships right after I
                        assert f"I{step.stage}.{step.micro}" in tokens[: tokens.index(step.token)]
    assert built > 0


def test_zb_p2_v1_m4_order() -> None:
    """The body at P = 2, V = 1, M = 4 with its idle slots, by hand from the rules
    (``docs/schedule.md``, "Zero bubble"): the limit is P = 2 activations. Rank 0 runs F0.0 F0.1,
    waits one slot for its first input gradient, then per micro-batch I, W (to make room) and F.
    Rank 1 alternates F and I and runs each W in the slot where its next forward has not arrived
    yet. Both ranks: 12 compute slots plus P - 1 = 1 idle, against 1F1B's (M + P - 1)·3 = 15."""
    plan = build_plan(PlanConfig(pp=2, micro=4, body="zb"))
    assert to_text(plan, with_idle=True).splitlines() == [
        "r0: F0.0 Fsend0.0 F0.1 Fsend0.1 · Brecv0.0 I0.0 W0.0 Brecv0.1 F0.2 Fsend0.2 I0.1 W0.1 Brecv0.2 "
        "F0.3 Fsend0.3 I0.2 W0.2 Brecv0.3 I0.3 W0.3",
        "r1: · Frecv1.0 F1.0 Frecv1.1 I1.0 Bsend1.0 F1.1 I1.1 Bsend1.1 W1.0 Frecv1.2 F1.2 I1.2 Bsend1.2 "
        "W1.1 Frecv1.3 F1.3 I1.3 Bsend1.3 W1.2 W1.3",
    ]


def _swapped(config: PlanConfig, rank: int, a: str, b: str) -> Plan:
    """The plan of ``config`` with two steps of ``rank`` swapped, as its own body (so only the
    dependency rules can object)."""
    rows = [[codes.encode_step(Step.parse(t)) for t in row] for row in _rows(build_plan(config))]
    i, j = (rows[rank].index(codes.encode_step(Step.parse(t))) for t in (a, b))
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    return Plan(config, rows, rows)


def test_validator_rejects_w_before_its_i() -> None:
    config = PlanConfig(pp=2, micro=4, body="zb")
    with pytest.raises(DependencyError, match=r"W1\.0 .* runs before I1\.0"):
        validate(_swapped(config, 1, "I1.0", "W1.0"))


def test_validator_rejects_an_i_before_its_gradient_arrives() -> None:
    config = PlanConfig(pp=2, micro=4, body="zb")
    with pytest.raises(DependencyError, match=r"I0\.0 .* runs before Brecv0\.0"):
        validate(_swapped(config, 0, "Brecv0.0", "I0.0"))


def test_validator_wants_f_i_and_w_of_every_micro() -> None:
    config = PlanConfig(pp=2, micro=4, body="zb")
    body = [[c for c in row if c != codes.encode(StepKind.W, 1, 3)] for row in build_plan(config).body_codes]
    with pytest.raises(CoverageError, match=r"F, I and W .* missing W1\.3"):
        validate(Plan(config, body, body))


def test_validator_wants_tbwd_right_after_the_input_gradient() -> None:
    config = PlanConfig(pp=2, micro=4, body="zb", preprocess="trainable")
    rows = _rows(build_plan(config))
    row0 = rows[0]
    row0.remove("TBWD0")
    row0.insert(row0.index("W0.0") + 1, "TBWD0")
    with pytest.raises(InvariantError, match=r"TBWD0 must directly follow I0\.0"):
        validate(Plan.from_tokens(config, rows))


# Memory.


@pytest.mark.parametrize(
    ("pp", "vpp", "micro"),
    [(2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 2, 4), (8, 1, 16), (4, 3, 12), (4, 2, 6), (3, 2, 2)],
)
def test_zb_holds_at_most_the_interleaved_peak(pp: int, vpp: int, micro: int) -> None:
    """Activations live from ``F`` to ``W`` with the split backward. Every rank holds exactly
    the limit ``(V-1)·R + P`` (at most ``V·M``) at its peak — ZB-H1 defers the later ranks' ``W``
    so they hold more than under 1F1B — and that is below the interleaved body's peak, which
    is on rank 0: ``(V-1)·R + 2(P-1) + 1`` (``test_schedule_memory``)."""
    zb = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, body="zb"))
    interleaved = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro))
    limit = min((vpp - 1) * _rounds(pp, micro)[0] + pp, vpp * micro)
    assert zb_activation_limit(pp, vpp, micro) == limit
    held = [peak_counts(zb, r)["activations"] for r in range(pp)]
    assert held == [limit] * pp
    assert max(held) <= max(peak_counts(interleaved, r)["activations"] for r in range(pp))


def test_output_gradients_are_held_from_i_to_w() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=4, body="zb"))
    order = [s.token for s in plan.order(0)]
    kept = [(order[it.start], order[it.end]) for it in held_items(plan, 0) if it.kind == "output gradients"]
    assert kept == [(f"I0.{m}", f"W0.{m}") for m in range(4)]
    # Rank 0 runs I0.0 F0.2 W0.0: one output gradient at a time; rank 1 defers W1.0 past I1.1.
    assert [peak_counts(plan, r)["output gradients"] for r in range(2)] == [1, 2]
    stage_input = [
        (order[it.start], order[it.end]) for it in held_items(plan, 0) if it.kind == "receives"
    ]  # a received gradient is read by I alone
    assert stage_input == [(f"Brecv0.{m}", f"I0.{m}") for m in range(4)]


def test_a_stage_input_lives_until_w() -> None:
    """``W`` reads the stage input (its first layer's input): the receive lives until ``W s.m``."""
    plan = build_plan(PlanConfig(pp=2, micro=4, body="zb"))
    order = [s.token for s in plan.order(1)]
    recv = [(order[it.start], order[it.end]) for it in held_items(plan, 1) if it.kind == "receives"]
    assert recv == [(f"Frecv1.{m}", f"W1.{m}") for m in range(4)]


def test_peak_bytes_weighs_output_gradients() -> None:
    plan = build_plan(PlanConfig(pp=2, micro=4, body="zb"))
    without = peak_bytes(plan, 1, ItemSizes(activations={1: 10}, stage_inputs={}))
    with_grads = peak_bytes(plan, 1, ItemSizes(activations={1: 10}, stage_inputs={}, output_gradients={1: 1}))
    assert without == 20 and with_grads == 22  # 2 micro-batches' activations, 2 kept output gradients
    with pytest.raises(ValueError, match=r"output_gradients\[1\] must be >= 0"):
        ItemSizes(activations={}, stage_inputs={}, output_gradients={1: -1})


# Torch's rules and torch's construction.

_ACTION = re.compile(r"(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")


def _torch_style_validate(rows: list[list[str]], pp: int, num_stages: int, micro: int) -> None:
    """The checks torch.distributed.pipelining's ``_validate_schedule`` documents, written out:
    every action parses; per stage, ``F`` before ``I`` (or ``B``) and ``I`` before ``W`` in the
    order of the rank that runs it; one rank per stage; every stage runs ``F`` of every micro,
    as many ``W`` as ``I``, and ``B + (I + W)/2`` backwards, one per micro."""
    assert len(rows) == pp
    seen = {s: {k: set() for k in "FIBW"} for s in range(num_stages)}
    rank_of: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for action in row:
            match = _ACTION.fullmatch(action)
            assert match, f"not an action: {action}"
            stage, kind, m = int(match[1]), match[2], int(match[3])
            assert 0 <= stage < num_stages and 0 <= m < micro
            assert rank_of.setdefault(stage, rank) == rank, (
                f"stage {stage} on ranks {rank_of[stage]} and {rank}"
            )
            if kind in "IB":
                assert m in seen[stage]["F"], f"{action} before its forward"
            if kind == "W":
                assert m in seen[stage]["I"], f"{action} before its input backward"
            if kind in seen[stage]:
                assert m not in seen[stage][kind], f"{action} twice"
                seen[stage][kind].add(m)
    for stage, done in seen.items():
        assert len(done["F"]) == micro, f"stage {stage}: {len(done['F'])} F"
        assert len(done["I"]) == len(done["W"]), f"stage {stage}: I and W counts differ"
        assert len(done["B"]) + (len(done["I"]) + len(done["W"])) // 2 == micro


@pytest.mark.parametrize(
    ("pp", "vpp", "micro"), [(2, 1, 4), (4, 1, 8), (4, 2, 8), (3, 2, 5), (4, 1, 2), (1, 2, 3)]
)
def test_the_csv_passes_torch_style_checks(pp: int, vpp: int, micro: int) -> None:
    plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, body="zb"))
    rows = list(csv.reader(io.StringIO(to_csv(plan))))
    assert any("I" in a for row in rows for a in row) and any("W" in a for row in rows for a in row)
    _torch_style_validate(rows, pp, pp * vpp, micro)
    compute = [[a for a in row if _ACTION.fullmatch(a)[2] in "FIW"] for row in rows]
    for rank, row in enumerate(plan.body):  # the CSV is the body in torch's spelling
        assert compute[rank] == [
            f"{s.stage}{s.kind.value}{s.micro}" for s in row if codes.is_compute(codes.encode_step(s))
        ]


def _torch_zb1p(pp: int, vpp: int, micro: int) -> list[list[str]]:
    """torch's ``ScheduleInterleavedZeroBubble`` compute order, from its documented construction:
    rank ``r`` runs ``(V-1)·R + P-1-r`` warm-up forwards, then forward/input-backward pairs, a
    ``W`` after each pair once ``r`` pairs have run, then the remaining ``I`` (each with a ``W``
    on the same rule) and the remaining ``W``; chunks as in interleaved 1F1B. Needs
    ``M % rounds == 0``."""
    rounds = max(1, micro // pp)
    per_round = micro // rounds
    total = vpp * micro
    out = []
    for rank in range(pp):
        warmup = min((vpp - 1) * per_round + pp - 1 - rank, total)

        def f_stage(op: int, rank: int = rank) -> int:
            return (op // per_round) % vpp * pp + rank

        def b_stage(op: int, rank: int = rank, warmup: int = warmup) -> int:
            return (vpp - 1 - (op - warmup) // per_round % vpp) * pp + rank

        count: dict[tuple[str, int], int] = {}
        row: list[str] = []

        def emit(kind: str, stage: int, row: list[str] = row, count: dict = count) -> None:
            m = count.get((kind, stage), 0)
            count[kind, stage] = m + 1
            row.append(f"{stage}{kind}{m}")

        backwards: list[int] = []
        for op in range(total + warmup):
            if op < total:
                emit("F", f_stage(op))
            if op >= warmup:
                emit("I", b_stage(op))
                backwards.append(op)
                if op - warmup >= rank:
                    emit("W", b_stage(backwards[len([a for a in row if "W" in a])]))
        while (n := len([a for a in row if "W" in a])) < len(backwards):
            emit("W", b_stage(backwards[n]))
        out.append(row)
    return out


def _plan_of(config: PlanConfig, rows: list[list[str]]) -> Plan:
    """A plan whose body is the given compute orders (torch spelling), slotted and with P2P."""
    orders = []
    for row in rows:
        parsed = [_ACTION.fullmatch(a) for a in row]
        orders.append([codes.encode(StepKind(m[2]), int(m[1]), int(m[3])) for m in parsed])
    body = insert_p2p(unit_time_slots(config.pp, config.vpp, orders), config.pp, config.vpp, False)
    return Plan(config, body, body)


@pytest.mark.parametrize(
    ("pp", "vpp", "micro"), [(2, 1, 4), (4, 1, 8), (4, 2, 8), (2, 2, 4), (8, 1, 16), (4, 2, 16)]
)
def test_against_torchs_zero_bubble_order(pp: int, vpp: int, micro: int) -> None:
    """Where both are defined (``M`` a multiple of torch's rounds): torch's order passes the same
    checks and our validator; both hold the same activations on every rank; under
    ``F = I = W = 1`` ours is as fast, or (P=4, V=2, M=16) one unit slower. At ``V = 1`` the first
    and last ranks run the same order; the ranks between differ only in when their forwards run
    (ours as soon as input and memory allow, torch's after ``P-1-r`` warm-up forwards in F/I
    pairs) — ``docs/schedule.md``, "Zero bubble"."""
    from graph_exec.simulate import OpCosts, simulate

    config = PlanConfig(pp=pp, vpp=vpp, micro=micro, body="zb")
    ours = build_plan(config)
    reference = _torch_zb1p(pp, vpp, micro)
    _torch_style_validate(reference, pp, pp * vpp, micro)
    theirs = _plan_of(config, reference)
    validate(theirs)
    for rank in range(pp):
        assert peak_counts(ours, rank)["activations"] == peak_counts(theirs, rank)["activations"]
    costs = OpCosts(forward=1, backward=2, input_backward=1, weight_backward=1)
    slower = simulate(ours, costs).step_time - simulate(theirs, costs).step_time
    assert slower == (1 if (pp, vpp, micro) == (4, 2, 16) else 0)
    ours_compute = [
        [a for a in row if _ACTION.fullmatch(a)[2] in "FIW"] for row in csv.reader(io.StringIO(to_csv(ours)))
    ]
    if vpp == 1:
        assert ours_compute[0] == reference[0] and ours_compute[-1] == reference[-1]


def test_no_configuration_is_refused() -> None:
    """The construction serves every M, M < P included (docs/schedule.md, "Zero bubble"): all of
    P <= 8, V <= 4, M <= 20 build and validate, with the F/I/W counts of every stage."""
    for pp, vpp, micro in itertools.product(range(1, 9), range(1, 5), range(1, 21)):
        plan = build_plan(PlanConfig(pp=pp, vpp=vpp, micro=micro, body="zb"))
        compute = [c for row in plan.body_codes for c in row if codes.is_compute(c)]
        assert len(compute) == 3 * pp * vpp * micro
