"""The example orders of ``docs/schedule.md``, "Worked examples" (and the compute skeleton of
"Interleaved 1F1B"), reproduced exactly."""

from __future__ import annotations

from graph_exec.schedule import PlanConfig, StepKind, build_plan, to_text


def _lines(**kwargs) -> list[str]:
    return to_text(build_plan(PlanConfig(**kwargs))).splitlines()


def test_body_p2_v1_m4_with_p2p() -> None:
    assert _lines(pp=2, vpp=1, micro=4) == [
        "r0: F0.0 Fsend0.0 F0.1 Fsend0.1 Brecv0.0 F0.2 Fsend0.2 B0.0 Brecv0.1 F0.3 Fsend0.3 B0.1 "
        "Brecv0.2 B0.2 Brecv0.3 B0.3",
        "r1: Frecv1.0 F1.0 Frecv1.1 B1.0 Bsend1.0 F1.1 Frecv1.2 B1.1 Bsend1.1 F1.2 Frecv1.3 B1.2 "
        "Bsend1.2 F1.3 B1.3 Bsend1.3",
    ]


def test_compute_skeleton_p2_v2_m4_with_idle_slots() -> None:
    plan = build_plan(PlanConfig(pp=2, vpp=2, micro=4))
    skeleton = [
        " ".join(s.token for s in row if s.kind in (StepKind.F, StepKind.B, StepKind.IDLE))
        for row in plan.with_idle
    ]
    assert skeleton == [
        "F0.0 F0.1 F2.0 F2.1 · F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 · B2.2 · B2.3 · B0.2 · B0.3",
        "· F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 · B1.2 · B1.3",
    ]


def test_mpipe_trainable_replicated_full_central() -> None:
    assert _lines(pp=2, vpp=1, micro=4, preprocess="trainable") == [
        "r0: BCAST TFWD0 TFWD2 OUTrecv1 OUTrecv3 F0.0 Fsend0.0 F0.1 Fsend0.1 Brecv0.0 F0.2 Fsend0.2 "
        "B0.0 TBWD0 Brecv0.1 F0.3 Fsend0.3 B0.1 TBWD1 Brecv0.2 B0.2 TBWD2 Brecv0.3 B0.3 TBWD3",
        "r1: BCAST TFWD1 TFWD3 OUTsend1 OUTsend3 Frecv1.0 F1.0 Frecv1.1 B1.0 Bsend1.0 F1.1 Frecv1.2 "
        "B1.1 Bsend1.1 F1.2 Frecv1.3 B1.2 Bsend1.2 F1.3 B1.3 Bsend1.3",
    ]


def test_mpipe_trainable_owned_min_central() -> None:
    assert _lines(pp=2, vpp=1, micro=4, preprocess="trainable", run_ahead="min", input="owned") == [
        "r0: BCAST TFWD0 OUTrecv1 INrecv1 F0.0 Fsend0.0 F0.1 Fsend0.1 Brecv0.0 TFWD2 F0.2 Fsend0.2 "
        "B0.0 TBWD0 Brecv0.1 TFWD3 F0.3 Fsend0.3 B0.1 TBWD1 Brecv0.2 B0.2 TBWD2 Brecv0.3 B0.3 TBWD3",
        "r1: BCAST TFWD1 OUTsend1 INsend1 Frecv1.0 F1.0 Frecv1.1 B1.0 Bsend1.0 F1.1 Frecv1.2 B1.1 "
        "Bsend1.1 F1.2 Frecv1.3 B1.2 Bsend1.2 F1.3 B1.3 Bsend1.3",
    ]


def test_body_p2_v2_m2_derived_by_hand() -> None:
    # Rounds [2]; warmup r0 = min(2+2, 4) = 4, r1 = min(2, 4) = 2. Slots:
    #   r0: F0.0 F0.1 F2.0 F2.1 · · B2.0 · B2.1 · B0.0 · B0.1
    #   r1: · F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 · B1.0 · B1.1
    # then the column scan (rank 0 before rank 1 within a slot).
    assert _lines(pp=2, vpp=2, micro=2) == [
        "r0: F0.0 Fsend0.0 F0.1 Fsend0.1 Frecv2.0 F2.0 Fsend2.0 Frecv2.1 F2.1 Fsend2.1 Brecv2.0 B2.0 "
        "Bsend2.0 Brecv2.1 B2.1 Bsend2.1 Brecv0.0 B0.0 Brecv0.1 B0.1",
        "r1: Frecv1.0 F1.0 Frecv1.1 Fsend1.0 F1.1 Frecv3.0 Fsend1.1 F3.0 Frecv3.1 B3.0 Bsend3.0 F3.1 "
        "B3.1 Brecv1.0 Bsend3.1 B1.0 Brecv1.1 Bsend1.0 B1.1 Bsend1.1",
    ]


def test_fewer_micros_than_ranks_gets_the_extra_idle_slots() -> None:
    # M=2 < P=3, V=1, one round of 2. Per rank i: i idle; warmup min(2(2-i), 2) forwards (no
    # extra idle after F of micro 1: it is the last warm-up op of a non-last rank); then
    # max(0, 2(2-i)-2) + (2-i) idle; r2 alone has a steady phase, with 2(P-M)=2 idle after
    # B2.1; cooldown "· B" per op, with 2 idle after the B of micro 1.
    #   r0: F0.0 F0.1 + (2+2)·  + · B0.0 · B0.1 ··
    #   r1: · F1.0 F1.1 + (0+1)· + · B1.0 · B1.1 ··
    #   r2: ·· F2.0 B2.0 F2.1 B2.1 ··
    plan = build_plan(PlanConfig(pp=3, vpp=1, micro=2))
    skeleton = [
        " ".join(s.token for s in row if s.kind in (StepKind.F, StepKind.B, StepKind.IDLE))
        for row in plan.with_idle
    ]
    assert skeleton == [
        "F0.0 F0.1 · · · · · B0.0 · B0.1 · ·",
        "· F1.0 F1.1 · · B1.0 · B1.1 · ·",
        "· · F2.0 B2.0 F2.1 B2.1 · ·",
    ]
