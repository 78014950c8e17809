"""The fair baseline (MPipe without transposition) on 2 and 4 real ranks, against the reference.

One msrun launch per world size runs every case (graph and pynative, frozen and trainable,
V=1 and 2, other ranks passing the preprocess or None); see workers/baseline_checks.py.
"""

import pytest

from tests.multirank.conftest import checks


@pytest.mark.parametrize(("suite", "ranks"), [("p2", 2), ("p4", 4)])
def test_fair_baseline_matches_reference(run_workers, suite, ranks):
    result = run_workers("baseline_checks.py", ranks, suite, timeout_s=900)
    for rank in range(ranks):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert any(name.endswith(".grads") for name in checks(result, rank))
        assert any(name.endswith(".preprocess_on_rank_0_only") for name in checks(result, rank))
    assert any(name.endswith(".losses") for name in checks(result, ranks - 1))
