"""Shape buckets and dynamic shapes on 2 ranks under msrun: both schedules, both modes, frozen
and trainable preprocess, mean and per-token loss, recompute, against the reference on the
unpadded batch (what each check compares: tests/multirank/workers/shape_checks.py). One launch."""

import re

import pytest

from tests.multirank.conftest import checks

#: Checks that must have passed on the rank named (besides "no FAIL line").
EXPECTED = {
    0: [
        "mpipe_trainable_graph_token.len16.grads",
        "mpipe_trainable_graph_token.seen_bucket_compiles_nothing",
        "mpipe_trainable_graph_token.mindspore_count_exposed",
        "mpipe_frozen_graph_mean.len5.grads",
        "mpipe_trainable_pynative_mean.len12.grads",
        "baseline_trainable_graph_mean.len16.grads",
        "baseline_trainable_graph_mean.too_long_refused",
        "dynamic_trainable_graph_token.len20.grads",
        "dynamic_trainable_graph_token.no_compile_after_the_second_shape",
        "dynamic_frozen_graph_mean_recompute.len9.grads",
        "dynamic_frozen_graph_mean_recompute.no_compile_after_the_second_shape",
        "dynamic_baseline_trainable_pynative_mean.len20.grads",
    ],
    1: [
        "mpipe_trainable_graph_token.len5.losses",
        "mpipe_trainable_graph_token.len12.losses",
        "mpipe_trainable_graph_token.evaluate",
        "mpipe_frozen_graph_mean.len16.losses",
        "mpipe_frozen_graph_mean.seen_bucket_compiles_nothing",
        "mpipe_trainable_pynative_mean.len16.losses",
        "mpipe_frozen_pynative_token.len12.losses",
        "mpipe_frozen_pynative_token.evaluate",
        "baseline_trainable_graph_mean.len16.losses",
        "baseline_trainable_graph_mean.seen_bucket_compiles_nothing",
        "dynamic_trainable_graph_token.len9.losses",
        "dynamic_trainable_graph_token.evaluate",
        "dynamic_frozen_graph_mean_recompute.len20.losses",
        "dynamic_frozen_graph_mean_recompute.no_compile_after_the_second_shape",
        "dynamic_baseline_trainable_pynative_mean.len16.losses",
    ],
}


@pytest.mark.timeout(300)
def test_bucketed_runs_match_the_reference_on_the_unpadded_batch(run_workers):
    result = run_workers("shape_checks.py", 2, timeout_s=240)
    for rank in range(2):
        log = result.worker_logs[rank]
        assert "ALL DONE failures=0" in log, result.describe()
        cases = re.search(r"^SUITE \S+ cases: (.+)$", log, re.MULTILINE).group(1).split()
        passed = checks(result, rank)
        assert all(any(name.startswith(f"{case}.") for name in passed) for case in cases)
        missing = [name for name in EXPECTED[rank] if name not in passed]
        assert not missing, (missing, result.describe())
