"""Bounded per-shape caches on 2 ranks: 50 steps of distinct shapes, the held bytes level off at
``buffer_cache_bytes`` on both paths (what each check says: tests/multirank/workers/cache_checks.py).
The CPU fast path keeps send frames per layout, the device path receive slots per exact size:
each path's growing cache must be among those that reached the bound."""

import re

import pytest

from tests.multirank.conftest import checks

BOUND = 16 * 1024  #: the workers' buffer_cache_bytes
GROWS = {False: "send_frames", True: "receive_slots"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device_path", [False, True], ids=["fast_path", "device_path"])
def test_buffer_caches_level_off_over_fifty_distinct_shapes(run_workers, device_path):
    result = run_workers("cache_checks.py", 2, timeout_s=540, device_path=device_path)
    grows = GROWS[device_path]
    for rank in range(2):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        passed = checks(result, rank)
        want = {f"step{k}.grads" for k in range(9, 50, 10)} | {"some_cache_evicted", "kernels.bounded"}
        want |= {f"{grows}.{what}" for what in ("within_bound", "bound_reported", "levels_off")}
        assert want <= passed, (sorted(want - passed), result.describe())
        let_go = int(re.search(rf"^LET_GO {grows} (\d+)$", log, re.MULTILINE).group(1))
        assert let_go > 3 * BOUND, (let_go, result.describe())
