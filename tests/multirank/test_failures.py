"""Failure paths on real ranks: set-up mismatches, a rank raising (pynative, graph, rank 0, in
TFWD, BCAST, GRADreduce), a rank hanging, a rank dying, an abort with P = 4.

Each scenario is one msrun launch (a mid-step failure loses the message order, so it ends its
job). The worker checks on every rank the error type, the rank, step and cause in the message,
how long the report took, that caches and buffers were released and that the schedule refuses
to run again; the launch limit bounds the whole job, so a hang fails the test.
"""

import pytest

from tests.multirank.conftest import checks

#: What every rank must have checked, per scenario (the worker adds .released and
#: .refuses_after_failure to each mid-step check).
SCENARIOS = {
    "setup": (
        2,
        {
            "replica_shapes_differ",
            "rank_without_preprocess",
            "frozen_values_differ",
            "stages_do_not_fit_world",
            # a first compile longer than timeout_s, within compile_timeout_s: not named hung
            "slow_compile.not_named_hung",
            "slow_compile.compiled_slowly",
        },
        "raise_pynative",
    ),
    "graph_rank0": (2, set(), "graph_rank0_tfwd"),
    "bcast": (2, set(), "bcast"),
    "gradreduce": (2, set(), "gradreduce"),
    "hang": (2, set(), "hang"),
    "p4": (4, set(), "p4_abort"),
}


def step_checks(name: str) -> set[str]:
    return {
        f"{name}.healthy_step_first",
        name,
        f"{name}.settled",
        f"{name}.released",
        f"{name}.refuses_after_failure",
    }


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_failure_is_reported_on_every_rank_in_time(run_workers, scenario):
    ranks, setup, step = SCENARIOS[scenario]
    result = run_workers("failure_checks.py", ranks, scenario, timeout_s=180)
    for rank in range(ranks):
        assert setup | step_checks(step) <= checks(result, rank), result.describe()


def test_a_dead_rank_is_reported_and_the_job_ends(run_workers):
    result = run_workers("failure_checks.py", 2, "death", timeout_s=120, expect_ok=False)
    assert "rank 1 dies now" in result.worker_logs[1], result.describe()
    assert "death.survived" not in result.worker_logs[1]
    assert step_checks("death") <= checks(result, 0), result.describe()
