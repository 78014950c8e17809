"""MindSpore ONE models cut by graph_exec.models on 2 real ranks, against the whole model.

One msrun launch runs every case (see workers/mindone_checks.py): Qwen2-VL in graph and
pynative mode with the vision tower frozen and trainable, central and owner backward, the fair
baseline on a rebalanced split, and Llama with its trainable embedding as the preprocess.
"""

import pytest

from tests.multirank.conftest import checks

#: How many cases the worker runs (its CASES; not imported here: that would import mindone at
#: collection).
CASES = 6


@pytest.mark.timeout(600)
def test_split_mindone_models_match_the_whole_model(run_workers):
    result = run_workers("mindone_checks.py", 2, timeout_s=540)
    for rank in range(2):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert sum(name.endswith(".grads") for name in checks(result, rank)) == CASES
    assert sum(name.endswith(".losses") for name in checks(result, 1)) == CASES
