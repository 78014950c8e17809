"""``recompute=True`` at P = 2 in both modes against the reference, in one msrun launch (the
``recompute`` suite of the pipeline worker: same checks as the default path)."""

from tests.multirank.conftest import checks


def test_recompute_matches_reference_in_both_modes(run_workers):
    result = run_workers("pipeline_checks.py", 2, "recompute", timeout_s=900)
    for rank in (0, 1):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
    names = checks(result, 0) | checks(result, 1)
    for case in ("graph_v1_trainable_central", "pynative_v2_trainable_owner_min", "pynative_baseline_v2"):
        assert f"{case}.grads" in names, result.describe()
        assert f"{case}.nothing_kept" in names, result.describe()
    assert "pynative_v1_trainable_central.equals_graph_v1_trainable_central" in names
    assert "graph_v1_trainable_central.losses" in checks(result, 1)
