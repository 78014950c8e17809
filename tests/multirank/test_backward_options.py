"""The non-default backward options at P = 2 in both modes against the reference, in one msrun
launch (the ``backward_options`` suite of the pipeline worker: the same checks as the default
path): ``recompute=True``, and ``keep_preprocess_tape=True`` with central and owner backward."""

from tests.multirank.conftest import checks


def test_backward_options_match_reference_in_both_modes(run_workers):
    result = run_workers("pipeline_checks.py", 2, "backward_options", timeout_s=900)
    for rank in (0, 1):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
    names = checks(result, 0) | checks(result, 1)
    cases = (
        "graph_v1_trainable_central",
        "pynative_v2_trainable_owner_min",
        "pynative_baseline_v2",
        "tape_v1_owner_full",
        "tape_v1_owner_full_pynative",
        "tape_v2_central_full",
        "tape_v2_owner_min_m5",
    )
    for case in cases:
        assert f"{case}.grads" in names, result.describe()
        assert f"{case}.nothing_kept" in names, result.describe()
    assert "pynative_v1_trainable_central.equals_graph_v1_trainable_central" in names
    assert "tape_v1_owner_full_pynative.equals_tape_v1_owner_full" in names
    assert "graph_v1_trainable_central.losses" in checks(result, 1)
