"""The named predicates over step codes agree with the decoded step, for every kind."""

from __future__ import annotations

import pytest

from graph_exec.schedule import StepKind, codes
from graph_exec.schedule.steps import (
    BODY_KINDS,
    GLOBAL_KINDS,
    MPIPE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    STAGED_KINDS,
)

K = StepKind


def _samples(kind: StepKind) -> list[int]:
    """Codes of ``kind`` at the edges of the fields: stage and micro 0, 1 and the largest."""
    top = codes.FIELD_MASK
    stages = [0, 1, top] if kind in STAGED_KINDS else [None]
    micros = [None] if kind in GLOBAL_KINDS else [0, 1, top]
    return [codes.encode(kind, s, m) for s in stages for m in micros]


@pytest.mark.parametrize("kind", list(StepKind))
def test_predicates_match_the_kind(kind: StepKind) -> None:
    for code in _samples(kind):
        step = codes.decode(code)
        assert step.kind is kind
        assert codes.is_forward(code) == (kind is K.F)
        assert codes.is_backward(code) == (kind is K.B)
        assert codes.is_input_backward(code) == (kind is K.I)
        assert codes.is_weight_backward(code) == (kind is K.W)
        assert codes.is_compute(code) == (kind in (K.F, K.B, K.I, K.W))
        assert codes.is_stage0_forward(code) == (kind is K.F and step.stage == 0)
        assert codes.is_stage0_backward(code) == (kind is K.B and step.stage == 0)
        assert codes.is_stage0_gradient_source(code) == (kind in (K.B, K.I) and step.stage == 0)
        assert codes.is_body(code) == (kind in BODY_KINDS)
        assert codes.is_mpipe(code) == (kind in MPIPE_KINDS)
        assert codes.is_send(code) == (kind in SEND_KINDS)
        assert codes.is_recv(code) == (kind in RECV_KINDS)


def test_field_accessors_round_trip() -> None:
    code = codes.encode(K.BSEND, 5, 9)
    assert (codes.kind_base(code), codes.stage_of(code), codes.micro_of(code)) == (codes.BSEND, 5, 9)
    assert codes.token(code) == "Bsend5.9"
