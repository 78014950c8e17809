"""``tower_order="balanced"`` at P = 2 (workers/tower_order_checks.py): losses in the user's order
and every gradient match the non-pipelined reference (atol 1e-5, rtol 1e-4), and both ranks
decide the same placement without exchanging a message."""

from __future__ import annotations

import re

from tests.multirank.conftest import checks
from tests.multirank.workers.tower_order_checks import CASES

_ORDER = re.compile(r"^ORDER (\S+) (\S+)$", re.MULTILINE)


def test_balanced_placement_matches_reference_at_two_ranks(run_workers) -> None:
    result = run_workers("tower_order_checks.py", 2, timeout_s=600)
    orders = [dict(_ORDER.findall(result.worker_logs[rank])) for rank in (0, 1)]
    assert set(orders[0]) == {case.name for case in CASES}
    assert orders[0] == orders[1], result.describe()
    assert orders[0]["mpipe_v1_trainable_graph"] != "0,1,2,3"  # towers 4,1,4,1: moved
    assert orders[0]["baseline_v1_trainable_graph"] != "0,1,2,3"  # the 3 moves into rank 0's slack
    for rank in (0, 1):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert {f"{case.name}.grads" for case in CASES} <= checks(result, rank)
    assert {f"{case.name}.losses" for case in CASES} <= checks(result, 1)
