"""The validator catches each kind of broken plan and names the ranks and steps involved."""

from __future__ import annotations

import pytest

from graph_exec.errors import GraphExecError
from graph_exec.schedule import (
    CoverageError,
    DeadlockError,
    DependencyError,
    FifoOrderError,
    InvariantError,
    PairingError,
    Plan,
    PlanConfig,
    ScheduleError,
    build_plan,
    to_text,
    validate,
)
from graph_exec.schedule.codes import encode_step
from graph_exec.schedule.steps import Step

MPIPE = PlanConfig(pp=2, vpp=1, micro=4, preprocess="trainable")


def _rows(plan: Plan) -> list[list[str]]:
    return [line.split(": ", 1)[1].split() for line in to_text(plan).splitlines()]


def _raw(config: PlanConfig, rows: list[str]) -> Plan:
    """A plan whose body *is* the given rows: to feed the validator broken bodies."""
    codes = [[encode_step(Step.parse(t)) for t in row.split()] for row in rows]
    return Plan(config, codes, codes)


def test_all_error_types_are_schedule_errors() -> None:
    for error in (
        CoverageError,
        DeadlockError,
        DependencyError,
        FifoOrderError,
        InvariantError,
        PairingError,
    ):
        assert issubclass(error, ScheduleError)
    assert issubclass(ScheduleError, GraphExecError)


def test_a_plan_read_back_from_its_tokens_validates() -> None:
    plan = build_plan(MPIPE)
    validate(Plan.from_tokens(MPIPE, _rows(plan)))
    with_idle = [line.split(": ", 1)[1].split() for line in to_text(plan, with_idle=True).splitlines()]
    validate(Plan.from_tokens(MPIPE, with_idle))


def test_reordered_body_is_not_the_body() -> None:
    rows = _rows(build_plan(MPIPE))
    rows[1][5], rows[1][6] = rows[1][6], rows[1][5]  # Frecv1.0 <-> F1.0
    with pytest.raises(InvariantError, match="rank 1: removing the MPipe steps does not give the body"):
        validate(Plan.from_tokens(MPIPE, rows))


def test_missing_mpipe_step() -> None:
    rows = _rows(build_plan(MPIPE))
    rows[0].remove("TBWD2")
    with pytest.raises(InvariantError, match=r"rank 0: MPipe steps do not match .*: missing TBWD2"):
        validate(Plan.from_tokens(MPIPE, rows))


def test_tbwd_must_directly_follow_its_backward() -> None:
    rows = _rows(build_plan(MPIPE))
    rows[0].remove("TBWD0")
    rows[0].append("TBWD0")
    with pytest.raises(InvariantError, match=r"TBWD0 must directly follow B0.0"):
        validate(Plan.from_tokens(MPIPE, rows))


def test_inline_tfwd_must_directly_precede_its_forward() -> None:
    config = PlanConfig(pp=2, vpp=1, micro=4, preprocess="frozen", run_ahead="min")
    rows = _rows(build_plan(config))
    rows[0].remove("TFWD3")
    rows[0].insert(rows[0].index("F0.3") + 1, "TFWD3")
    with pytest.raises(InvariantError, match=r"TFWD3 must directly precede F0.3"):
        validate(Plan.from_tokens(config, rows))


def test_grad_reduce_must_be_last() -> None:
    config = PlanConfig(pp=2, vpp=1, micro=4, preprocess="trainable", backward="owner")
    rows = _rows(build_plan(config))
    rows[1].remove("GRADreduce")
    rows[1].insert(len(rows[1]) - 1, "GRADreduce")
    with pytest.raises(InvariantError, match=r"rank 1: GRADreduce must be the last step"):
        validate(Plan.from_tokens(config, rows))


def test_forward_before_its_preprocess_output() -> None:
    rows = _rows(build_plan(MPIPE))
    rows[0].remove("TFWD2")
    rows[0].insert(rows[0].index("F0.2") + 1, "TFWD2")
    with pytest.raises(DependencyError, match=r"rank 0: F0.2 \(step #\d+\) runs before TFWD2"):
        validate(Plan.from_tokens(MPIPE, rows))


def test_receiving_out_of_order_is_reported_as_fifo_not_as_its_symptoms() -> None:
    rows = _rows(build_plan(MPIPE))
    rows[0].remove("OUTrecv1")
    rows[0].insert(rows[0].index("Fsend0.1") + 1, "OUTrecv1")  # also after F0.1, which reads it
    with pytest.raises(FifoOrderError, match="ranks 1->0: send #0 is OUTsend1 but receive #0 is OUTrecv3"):
        validate(Plan.from_tokens(MPIPE, rows))


def test_send_before_the_forward_that_fills_it() -> None:
    config = PlanConfig(pp=2, micro=1)
    plan = _raw(config, ["Fsend0.0 F0.0 Brecv0.0 B0.0", "Frecv1.0 F1.0 B1.0 Bsend1.0"])
    with pytest.raises(DependencyError, match=r"rank 0: Fsend0.0 \(step #0\) runs before F0.0"):
        validate(plan)


def test_repeated_and_missing_compute() -> None:
    config = PlanConfig(pp=2, micro=1)
    with pytest.raises(CoverageError, match=r"rank 0: steps appear more than once: F0.0"):
        validate(_raw(config, ["F0.0 F0.0 Fsend0.0 Brecv0.0 B0.0", "Frecv1.0 F1.0 B1.0 Bsend1.0"]))
    with pytest.raises(CoverageError, match=r"rank 1 must run F and B of stages \[1\] .*: missing B1.0"):
        validate(_raw(config, ["F0.0 Fsend0.0 Brecv0.0 B0.0", "Frecv1.0 F1.0 Bsend1.0"]))


def test_send_without_receive() -> None:
    config = PlanConfig(pp=2, micro=2)
    body = build_plan(config)
    rows = [" ".join(row) for row in _rows(body)]
    rows[0] = rows[0].replace("Fsend0.1 ", "")
    with pytest.raises(PairingError, match=r"rank 1 runs Frecv1\.1 from rank 0, which never sends it"):
        validate(_raw(config, rows))


def test_sends_in_a_different_order_than_receives() -> None:
    config = PlanConfig(pp=2, micro=2)
    rows = [
        "F0.0 F0.1 Fsend0.1 Fsend0.0 Brecv0.0 B0.0 Brecv0.1 B0.1",
        "Frecv1.0 F1.0 B1.0 Bsend1.0 Frecv1.1 F1.1 B1.1 Bsend1.1",
    ]
    with pytest.raises(FifoOrderError, match=r"ranks 0->1: send #0 is Fsend0.1 but receive #0 is Frecv1.0"):
        validate(_raw(config, rows))


def test_mpipe_transfers_out_of_order() -> None:
    config = PlanConfig(pp=3, micro=6, preprocess="frozen")
    rows = _rows(build_plan(config))
    i, j = rows[1].index("OUTsend1"), rows[1].index("OUTsend4")
    rows[1][i], rows[1][j] = rows[1][j], rows[1][i]
    with pytest.raises(FifoOrderError, match="ranks 1->0: send #0 is OUTsend4 but receive #0 is OUTrecv1"):
        validate(Plan.from_tokens(config, rows))


def test_deadlock_names_each_stuck_rank() -> None:
    config = PlanConfig(pp=2, micro=1)
    # Rank 0 waits for the gradient before sending the activation rank 1 waits for.
    plan = _raw(config, ["F0.0 Brecv0.0 Fsend0.0 B0.0", "Frecv1.0 F1.0 B1.0 Bsend1.0"])
    with pytest.raises(DeadlockError) as info:
        validate(plan)
    assert info.value.stuck == {0: "Brecv0.0 (from rank 1)", 1: "Frecv1.0 (from rank 0)"}
    assert "rank 0 waits at Brecv0.0 (from rank 1)" in str(info.value)
    assert "rank 1 waits at Frecv1.0 (from rank 0)" in str(info.value)


def test_collective_deadlock() -> None:
    config = PlanConfig(pp=2, micro=1, preprocess="trainable")
    # Rank 0 waits in the broadcast that rank 1 only reaches after the activation it waits for.
    rows = [
        ["BCAST", "TFWD0", "F0.0", "Fsend0.0", "Brecv0.0", "B0.0", "TBWD0"],
        ["Frecv1.0", "F1.0", "B1.0", "Bsend1.0", "BCAST"],
    ]
    with pytest.raises(DeadlockError) as info:
        validate(Plan.from_tokens(config, rows))
    assert info.value.stuck == {0: "BCAST (until every rank reaches it)", 1: "Frecv1.0 (from rank 0)"}
    rows[1].insert(0, rows[1].pop())  # BCAST first everywhere: fine
    validate(Plan.from_tokens(config, rows))
