"""``stats()["memory"]`` on 2 ranks, one launch: measured bytes against hand-derived counts
(see tests/multirank/workers/memory_checks.py)."""

import pytest

from tests.multirank.conftest import checks

CASES = ("i1f1b_taped", "i1f1b_recompute", "mpipe_frozen")
PARTS = ("per_micro", "activations", "receives", "preprocess_outputs", "rss")


@pytest.mark.timeout(360)
def test_measured_memory_matches_hand_derived_counts(run_workers):
    result = run_workers("memory_checks.py", 2, timeout_s=300)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert {f"{c}.{p}" for c in CASES for p in PARTS} <= checks(result, rank), result.describe()
