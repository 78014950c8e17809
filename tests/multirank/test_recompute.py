"""``recompute=True`` at P = 2 in both modes against the reference, in one msrun launch."""

from tests.multirank.conftest import checks


def test_recompute_matches_reference_in_both_modes(run_workers):
    result = run_workers("recompute_checks.py", 2, timeout_s=900)
    for rank in (0, 1):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        assert not [line for line in log.splitlines() if line.startswith("CHECK") and " FAIL" in line]
    names = checks(result, 0) | checks(result, 1)
    for case in ("graph_v1_trainable_central", "pynative_v2_trainable_owner_min", "pynative_baseline_v2"):
        assert f"{case}.grads" in names, result.describe()
    assert "pynative_v1_trainable_central.equals_graph_v1_trainable_central" in names
    assert "graph_v1_trainable_central.losses" in checks(result, 1)
