"""Pretrained directories on 2 and 4 real ranks: each rank loads only its share, against from_pretrained.

One msrun launch per pipeline size runs its cases (see workers/pretrained_checks.py): at P=2
Llama in graph mode, the tied Qwen2 in pynative, Qwen2-VL in both; at P=4 the other mode of
each language model (Llama pynative, tied Qwen2 graph) and Qwen2-VL in graph mode, so every
family runs in both modes and each size in both. After each case every rank exports and rank 0
checks the export against the input directory bit for bit.
"""

import numpy as np
import pytest

from tests.multirank.conftest import checks

#: ``pp → the worker's cases`` (not imported here: that would import mindone at collection).
CASES = {
    2: ("llama_graph", "qwen2_tied_pynative", "qwen2vl_graph", "qwen2vl_pynative"),
    4: ("llama_pynative", "qwen2_tied_graph", "qwen2vl_graph"),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pp", sorted(CASES))
def test_each_rank_loads_its_share_and_the_job_exports_one_directory(run_workers, tmp_path, pp):
    from graph_exec.examples.make_pretrained import make_pretrained

    root = tmp_path / "pretrained"
    for name in ("llama", "qwen2", "qwen2vl"):
        # float32: compared with mindone's from_pretrained, which computes a BF16 Qwen2-VL in part
        # in its torch_dtype (tests/runtime/test_pretrained.py builds the BF16 one's reference)
        make_pretrained(name, root / name, seed=5, layers=pp, dtype="float32")  # one layer per stage
    (root / "exports").mkdir()
    cases = CASES[pp]
    result = run_workers("pretrained_checks.py", pp, str(root), *cases, timeout_s=840)
    for rank in range(pp):
        assert "ALL DONE failures=0" in result.worker_logs[rank], result.describe()
        assert {f"{case}.grads" for case in cases} <= checks(result, rank)
    assert {f"{case}.losses" for case in cases} <= checks(result, pp - 1)
    assert {f"{case}.export_round_trip" for case in cases} <= checks(result, 0)
    assert {f"{case}.export_loads" for case in cases} <= checks(result, 0)
    for case in cases:
        assert (root / "exports" / case / "config.json").is_file()


@pytest.mark.timeout(600)
def test_cli_round_trip_and_trained_export(tmp_path):
    """``graph-exec run llama --pretrained DIR --dp 2 --steps 0 --export OUT`` reproduces a BF16 DIR
    (the Hub's layout) bit for bit, its non-weight files too; with ``--steps 2`` the export, BF16 too,
    differs from DIR and mindone's ``from_pretrained`` reads it."""
    import subprocess
    import sys

    from graph_exec.examples.make_pretrained import make_pretrained
    from graph_exec.hub.directory import PretrainedDirectory
    from tests.multirank.test_cli import ENV

    source = make_pretrained("llama", tmp_path / "in", seed=2)  # BF16, two shards
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    (source / "generation_config.json").write_text('{"eos_token_id": 2}')
    base = [sys.executable, "-m", "graph_exec.cli", "run", "llama", "--ranks", "2", "--vpp", "2"]
    base += ["--pretrained", str(source), "--mode", "pynative"]

    def tensors(folder):
        shards = PretrainedDirectory(folder)
        assert {dtype for _, _, dtype in shards.tensors.values()} == {"BF16"}
        return {name: shards.read(name, "stored") for name in shards.tensors}

    done = subprocess.run(  # two replicas of a one-rank pipeline: both join the export
        [*base, "--dp", "2", "--steps", "0", "--export", str(tmp_path / "same")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loaded and exported, no training" in done.stdout
    before, same = tensors(source), tensors(tmp_path / "same")
    assert sorted(before) == sorted(same)
    assert all(same[k].dtype == v.dtype and same[k].tobytes() == v.tobytes() for k, v in before.items())
    for file in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "same" / file).read_bytes() == (source / file).read_bytes()
    done = subprocess.run(
        [*base, "--steps", "2", "--export", str(tmp_path / "trained")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    trained = tensors(tmp_path / "trained")
    assert sorted(trained) == sorted(before)
    assert any(trained[k].tobytes() != v.tobytes() for k, v in before.items())
    import graph_exec.models as gm

    config = gm.pretrained.load_config(tmp_path / "trained")
    again = gm.model_class(config).from_pretrained(str(tmp_path / "trained"), attn_implementation="eager")
    widened = (trained["lm_head.weight"].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(again.lm_head.weight.asnumpy(), widened)
