"""The runtime on real ranks under msrun: every configuration against the reference.

Each launch runs a whole suite of configurations (communication init costs seconds); the
worker prints one ``CHECK`` line per comparison, and a test fails with every worker's log
tail if any check failed or a rank did not finish.
"""

import pytest

from tests.multirank.conftest import checks


def failed_lines(result, rank):
    return [
        line
        for line in result.worker_logs.get(rank, "").splitlines()
        if line.startswith("CHECK") and " FAIL" in line
    ]


@pytest.mark.parametrize(("suite", "ranks"), [("p2", 2), ("p4", 4)])
def test_pipeline_matches_reference(run_workers, suite, ranks):
    result = run_workers("pipeline_checks.py", ranks, suite, timeout_s=900)
    for rank in range(ranks):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert not failed_lines(result, rank), result.describe()
    # Every rank checked gradients of every case; the last rank also checked the losses.
    assert any(name.endswith(".grads") for name in checks(result, 0))
    assert any(name.endswith(".losses") for name in checks(result, ranks - 1))
