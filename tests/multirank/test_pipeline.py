"""The runtime on real ranks under msrun: every configuration against the reference.

Each launch runs a whole suite of configurations (communication init costs seconds); the
worker prints one ``CHECK`` line per comparison, and a test fails with every worker's log
tail if any check failed or a rank did not finish. Both schedules (MPipe Transpose and the
interleaved 1F1B baseline), both modes, and synchronous and asynchronous dispatch are covered
at P = 2 and P = 4.
"""

import re

import pytest

from tests.multirank.conftest import checks


@pytest.mark.timeout(960)  # the launch itself is bounded at 900 s
@pytest.mark.parametrize(("suite", "ranks"), [("p2", 2), ("p4", 4)])
def test_pipeline_matches_reference(run_workers, suite, ranks):
    result = run_workers("pipeline_checks.py", ranks, suite, timeout_s=900)
    for rank in range(ranks):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        cases = re.search(r"^SUITE \S+ cases: (.+)$", log, re.MULTILINE).group(1).split()
        passed = checks(result, rank)
        # Every case checked this rank's gradients after every step and ran its last step.
        for case in cases:
            assert {f"{case}.grads", f"{case}.last_grads"} <= passed, (case, result.describe())
        if rank == ranks - 1:
            assert all(f"{case}.losses" in passed for case in cases)
    assert any(case.startswith("i1f1b_") for case in cases)
