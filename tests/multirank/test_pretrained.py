"""Pretrained directories on 2 real ranks: each rank loads only its share, against from_pretrained.

One msrun launch runs every case (see workers/pretrained_checks.py): Llama in graph mode, the
tied Qwen2 in pynative, Qwen2-VL in both; after each, every rank exports and rank 0 checks
the export against the input directory bit for bit.
"""

import pytest

from tests.multirank.conftest import checks

#: The worker's CASES (not imported here: that would import mindone at collection).
CASES = ("llama_graph", "qwen2_tied_pynative", "qwen2vl_graph", "qwen2vl_pynative")


@pytest.mark.timeout(900)
def test_each_rank_loads_its_share_and_the_job_exports_one_directory(run_workers, tmp_path):
    from graph_exec.examples.make_pretrained import make_pretrained

    root = tmp_path / "pretrained"
    for name in ("llama", "qwen2", "qwen2vl"):
        make_pretrained(name, root / name, seed=5, layers=2)
    (root / "exports").mkdir()
    result = run_workers("pretrained_checks.py", 2, str(root), timeout_s=840)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert {f"{case}.grads" for case in CASES} <= checks(result, rank)
    assert {f"{case}.losses" for case in CASES} <= checks(result, 1)
    assert {f"{case}.export_round_trip" for case in CASES} <= checks(result, 0)
    assert {f"{case}.export_loads" for case in CASES} <= checks(result, 0)
    for case in CASES:
        assert (root / "exports" / case / "config.json").is_file()
