"""Batches of real Qwen2-VL samples on 2 real ranks, against the whole model on each unpadded
sample. One msrun launch runs every case (see workers/vlm_batch_checks.py): graph and
pynative, frozen and trainable tower, central and owner backward, V = 1 and 2,
``shapes="dynamic"`` over three batches whose shapes differ, and ragged micro-batches
(``vlm_micro_batches``, graph, dynamic, balanced placement) over two. The ``packed`` suite of the
same worker: packed Llama text rows, graph and pynative, against the whole Llama on each sample."""

import pytest

from tests.multirank.conftest import checks

#: (case, steps) as in the worker's CASES (not imported here: that would import mindone at collection).
CASES = {
    "vlmb_graph_frozen": 1,
    "vlmb_graph_trainable_owner": 1,
    "vlmb_pynative_trainable_v2": 1,
    "vlmb_pynative_frozen_v2": 1,
    "vlmb_graph_dynamic_trainable": 3,
    "vlmb_graph_dynamic_ragged": 2,
}


@pytest.mark.timeout(900)
def test_vlm_batches_match_the_whole_model_on_each_unpadded_sample(run_workers):
    result = run_workers("vlm_batch_checks.py", 2, timeout_s=840)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        done = checks(result, rank)
        for case, steps in CASES.items():
            assert {f"{case}.step{s}.grads" for s in range(steps)} <= done, (rank, case, sorted(done))
    last = checks(result, 1)
    assert all(f"{case}.step{s}.losses" in last for case, steps in CASES.items() for s in range(steps))


#: The worker's PACKED_CASES.
PACKED_CASES = ("packed_llama_graph", "packed_llama_pynative")


@pytest.mark.timeout(300)
def test_packed_rows_match_the_whole_model_on_each_sample_at_two_ranks(run_workers):
    """Packed rows (several samples per row, each attending only to itself) across a real
    transport: per-micro-batch per-token losses on the last rank and every gradient each rank
    holds equal the whole Llama on each sample alone (atol 1e-5, rtol 1e-4)."""
    result = run_workers("vlm_batch_checks.py", 2, "packed", timeout_s=240)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        done = checks(result, rank)
        assert {f"{case}.step0.grads" for case in PACKED_CASES} <= done, (rank, sorted(done))
    assert {f"{case}.step0.losses" for case in PACKED_CASES} <= checks(result, 1)
