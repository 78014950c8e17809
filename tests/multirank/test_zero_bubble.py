"""The split backward (``body="zb"``) on real ranks against the single-process reference: P = 2 and
P = 4, V = 1 and 2, graph and pynative, MPipe frozen and trainable with central and owner
backward, ``full`` and ``min`` run-ahead, the fair baseline and the plain interleaved schedule;
one msrun launch per world size (the ``zb_p2`` / ``zb_p4`` suites of the pipeline worker);
and dp2 x pp2 (the ``zb_dp2pp2`` suite of the mesh worker)."""

import pytest

from tests.multirank.conftest import checks
from tests.multirank.workers import mesh_checks
from tests.multirank.workers.pipeline_checks import SUITES


@pytest.mark.parametrize("world", [2, 4])
def test_zero_bubble_matches_reference(run_workers, world):
    result = run_workers("pipeline_checks.py", world, f"zb_p{world}", timeout_s=900)
    for rank in range(world):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
    for case in SUITES[f"zb_p{world}"]:
        for rank in range(world):
            names = checks(result, rank)
            assert f"{case.name}.grads" in names, result.describe()
            assert f"{case.name}.split_backward_ran" in names, result.describe()
            assert f"{case.name}.nothing_kept" in names, result.describe()
        assert f"{case.name}.losses" in checks(result, world - 1), result.describe()
        if case.same_as is not None:
            assert f"{case.name}.equals_{case.same_as}" in checks(result, 0)


def test_zero_bubble_on_a_dp2_pp2_mesh_matches_reference(run_workers):
    """Two replicas of a two-rank pipeline, body "zb": the averaged gradients and each
    replica's losses against the global-batch reference (mesh_checks' checks)."""
    result = run_workers("mesh_checks.py", 4, "zb_dp2pp2", timeout_s=900)
    for rank in range(4):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        names = checks(result, rank)
        for case in mesh_checks.SUITES["zb_dp2pp2"]:
            assert f"{case.name}.grads" in names, result.describe()
    for rank in (1, 3):
        assert {f"{c.name}.losses" for c in mesh_checks.SUITES["zb_dp2pp2"]} <= checks(result, rank)
