"""Header-free steady-state transfers on two real ranks: layouts announced once, shape changes,
mislabelled messages, and a restart after an aborted step (one msrun launch)."""

from tests.multirank.conftest import checks

BOTH = {
    "first_step_has_headers",
    "steady_state_header_free",
    "shape_changes_announced",
    "restart_epoch",
    "stale_skipped",
    "collective_after_restart",
    "restart_exchanges",
}


def test_header_free_transfers_shape_changes_mislabels_and_restart(run_workers):
    result = run_workers("steady_checks.py", 2)
    rank0, rank1 = checks(result, 0), checks(result, 1)
    values0 = {f"values_back_{s}" for s in (*range(9), 20, 21, 22)}
    values1 = {f"values_forward_{s}" for s in (*range(9), 20, 21, 22)}
    assert BOTH | values0 | {"abort_reported"} <= rank0, result.describe()
    assert (
        BOTH | values1 | {"announced_big", "mislabelled_header", "mislabelled_frame", "oversized_frame"}
        <= rank1
    ), result.describe()
