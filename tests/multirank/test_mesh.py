"""Data parallel x pipeline parallel under msrun: 4 ranks, one launch for every layout and the
bad-input checks (see tests/multirank/workers/mesh_checks.py for what each check compares)."""

from tests.multirank.conftest import checks
from tests.multirank.test_pipeline import failed_lines

CASES = (
    "dp2pp2_trainable_central",
    "dp2pp2_trainable_owner",
    "dp2pp2_frozen",
    "dp2pp2_baseline",
    "dp2pp2_replicas_start_equal",
    "dp4pp1_trainable",
    "dp4pp1_none_unscaled",
)
BAD_INPUTS = (
    "bad.mesh_before_init",
    "bad.dp_times_pp_not_world",
    "bad.ranks_disagree_on_mesh",
    "bad.replicas_disagree",
    "bad.setup_failure_stops_all_replicas",
)


def test_data_parallel_pipelines_match_the_global_batch_reference(run_workers):
    result = run_workers("mesh_checks.py", 4, "all", timeout_s=900)
    for rank in range(4):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert not failed_lines(result, rank), result.describe()
        seen = checks(result, rank)
        assert {f"{case}.grads" for case in CASES} <= seen, result.describe()
        assert set(BAD_INPUTS) <= seen, result.describe()
    # Losses are checked where they live: the last pipeline rank of each replica (pp=2: ranks 1
    # and 3) and every rank of the pp=1 layout.
    for rank in (1, 3):
        assert {f"{case}.losses" for case in CASES} <= checks(result, rank)
    for rank in (0, 2):
        assert "dp4pp1_trainable.losses" in checks(result, rank)
