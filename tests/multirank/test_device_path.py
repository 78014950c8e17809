"""The device path on CPU: the multi-rank numerics and failure suites with the CPU fast paths off.

``GRAPH_EXEC_CPU_FAST_PATHS=0`` makes every worker take the path a GPU or Ascend rank takes
(:mod:`graph_exec.device`): frames and receive slots are MindSpore tensors read only through
MindSpore, MindSpore's dispatch is asynchronous, gradients accumulate and buckets pack with
MindSpore ops, every transport call goes through the communication thread. Each launch checks
that its workers reported that policy. Asynchronous dispatch makes CPU steps several times
slower, so the pipeline suites are the ``device_*`` shares of the full ones (see
``workers/pipeline_checks.py``); the fair baseline, the data-parallel mesh and every failure
scenario run whole.
"""

import re

import pytest

from graph_exec.msenv import HOST_BLOCKING_ENV
from tests.multirank.conftest import checks
from tests.multirank.test_failures import SCENARIOS, step_checks


@pytest.mark.timeout(960)
@pytest.mark.parametrize(("suite", "ranks"), [("device_p2", 2), ("device_p4", 4)])
def test_pipeline_matches_reference_on_the_device_path(run_workers, suite, ranks):
    result = run_workers("pipeline_checks.py", ranks, suite, timeout_s=900, device_path=True)
    for rank in range(ranks):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        cases = re.search(r"^SUITE \S+ cases: (.+)$", log, re.MULTILINE).group(1).split()
        passed = checks(result, rank)
        for case in cases:
            assert {f"{case}.grads", f"{case}.last_grads", f"{case}.nothing_kept"} <= passed, (
                case,
                result.describe(),
            )
        if rank == ranks - 1:
            assert all(f"{case}.losses" in passed for case in cases)


@pytest.mark.timeout(960)
def test_fair_baseline_matches_reference_on_the_device_path(run_workers):
    result = run_workers("baseline_checks.py", 2, "p2", timeout_s=900, device_path=True)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert any(name.endswith(".grads") for name in checks(result, rank))
    assert any(name.endswith(".losses") for name in checks(result, 1))


@pytest.mark.timeout(960)
def test_data_parallel_pipelines_match_the_reference_on_the_device_path(run_workers):
    from tests.multirank.test_mesh import BAD_INPUTS, CASES

    result = run_workers("mesh_checks.py", 4, "all", timeout_s=900, device_path=True)
    for rank in range(4):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert {f"{case}.grads" for case in CASES} | set(BAD_INPUTS) <= checks(result, rank), (
            result.describe()
        )


@pytest.mark.timeout(420)
def test_low_precision_chunks_match_the_reference_on_the_device_path(run_workers):
    result = run_workers(
        "training_loop_checks.py", 2, "device_low_precision", timeout_s=360, device_path=True
    )
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        for case in ("float16_graph", "bfloat16_pynative"):
            assert f"{case}.grads" in checks(result, rank), result.describe()
    assert {"float16_graph.losses", "bfloat16_pynative.losses"} <= checks(result, 1), result.describe()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_failure_is_reported_on_every_rank_in_time_on_the_device_path(run_workers, scenario):
    """With MindSpore's asynchronous host pipeline, as on a device: an abandoned collective's
    late error must not surface after the step was reported (the ``settled`` checks)."""
    ranks, setup, step = SCENARIOS[scenario]
    asynchronous = {HOST_BLOCKING_ENV: None}
    result = run_workers(
        "failure_checks.py", ranks, scenario, timeout_s=240, device_path=True, env=asynchronous
    )
    for rank in range(ranks):
        assert setup | step_checks(step) <= checks(result, rank), result.describe()


def test_a_dead_rank_is_reported_and_the_job_ends_on_the_device_path(run_workers):
    result = run_workers("failure_checks.py", 2, "death", timeout_s=180, expect_ok=False, device_path=True)
    assert "rank 1 dies now" in result.worker_logs[1], result.describe()
    assert step_checks("death") <= checks(result, 0), result.describe()
