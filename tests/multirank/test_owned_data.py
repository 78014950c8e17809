"""Owned input through ``DataLoader(owned_by=schedule)`` with ``tower_order="balanced"`` at P = 2
(workers/owned_data_checks.py): one exchange of sizes gives both ranks the same costs and the
same placement (a rank that cannot size a sample makes every rank raise); each rank reads exactly the micro-batches placed on it (rank 0 only its own,
rank 1, holding the last stage, all of them); losses and every gradient equal replicated input
(bit for bit) and the non-pipelined reference (atol 1e-5, rtol 1e-4); ``evaluate()`` with owned
input and balanced placement gives the replicated losses (atol 1e-5, rtol 1e-4) from the rows each
rank holds; ``tower_costs`` one rounding step apart make every rank raise, naming both placements."""

from __future__ import annotations

import re

from tests.multirank.conftest import checks
from tests.multirank.workers.owned_data_checks import CASES, MICRO

_LINE = re.compile(r"^(ORDER|READ|BITWISE) (\S+) (\S+)$", re.MULTILINE)


def test_owned_reading_with_balanced_placement_matches_replicated_input(run_workers) -> None:
    result = run_workers("owned_data_checks.py", 2, timeout_s=600)
    seen = [
        {(kind, name): value for kind, name, value in _LINE.findall(result.worker_logs[r])} for r in (0, 1)
    ]
    names = {f"{case.name}.{step}" for case in CASES for step in (0, 1)}
    orders = [{name: seen[r][("ORDER", name)] for name in names} for r in (0, 1)]
    assert orders[0] == orders[1], result.describe()  # the same decision on both ranks
    assert any(order != ",".join(map(str, range(MICRO))) for order in orders[0].values()), orders[0]
    everything = ",".join(map(str, range(MICRO)))
    for name in names:
        assert seen[1][("READ", name)] == everything  # the last stage's rank needs every label
        assert seen[0][("READ", name)] != everything, (name, seen[0][("READ", name)])
    # the same rows in the same order through the same kernels: owned equals replicated bit for bit
    assert all(seen[r][("BITWISE", name)] == "True" for r in (0, 1) for name in names), seen
    for rank in (0, 1):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert "failing_size.raised" in checks(result, rank)  # a failed sizing is told to every rank
        # tower_costs one rounding step apart: every rank raises, naming both placements
        assert "disagreeing_costs.raised" in checks(result, rank)
        wanted = {
            f"{name}.{check}"
            for name in names
            for check in (
                "costs_exchanged",
                "read_what_is_placed_here",
                "read_each_once",
                "sized_its_share",
                "grads_equal_replicated",
                "grads",
            )
        }
        assert wanted <= checks(result, rank)
    assert {f"{name}.{check}" for name in names for check in ("losses", "losses_equal_replicated")} <= checks(
        result, 1
    )
    # evaluate() with owned input reads the rows the owned reading placed on each rank
    assert {f"{case.name}.eval_losses_equal_replicated" for case in CASES} <= checks(result, 1)
    assert {f"{case.name}.eval_ran" for case in CASES} <= checks(result, 0)
