"""The harness with real msrun workers: a FAIL line or a non-zero exit fails the test
(``tests/unit/test_multirank_harness.py`` covers every case without msrun)."""

import pytest


def test_fail_line_and_nonzero_exit_fail_the_test(run_workers):
    with pytest.raises(pytest.fail.Exception) as failure:
        run_workers("harness_probe.py", 2, timeout_s=180)
    report = str(failure.value)
    assert "FAIL line from rank 0: probe deliberately" in report, report
    assert "the job exited with code" in report, report
