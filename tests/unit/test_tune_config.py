"""``graph-exec tune --config``: a real-size model priced from its config.json alone (no MindSpore).

The parameter counts are checked against the mindone models in
``tests/runtime/test_config_params.py``; here the pricing: one plan's parameter and optimizer
bytes written out by hand, ZeRO-1's division, and the bad inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graph_exec.cli import main
from graph_exec.config_sizes import (
    ConfigError,
    Workload,
    config_costs,
    model_shape,
    param_counts,
    read_config,
)
from graph_exec.tune import Candidate, predict, tune

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def _shape(name: str):
    return model_shape(read_config(CONFIGS / name))


def test_qwen2_vl_7b_rank_0_parameters_and_optimizer_by_hand() -> None:
    """Qwen2-VL-7B in bfloat16, P = 4, V = 1 (7 layers a stage), D = 4 with ZeRO-1. One decoder
    layer: q 3584² + 3584, k and v 3584·512 + 512 each, o 3584², the MLP 3·3584·18944, two norms
    2·3584, the attention's rotary inv_freq 64 (a buffer the model holds as a Parameter). Rank 0
    holds 7 layers, the embedding 152064·3584 with the two rotary buffers (64 + 20) no cell
    holds, and the frozen vision tower (32 blocks of 1280 wide and the merger); it trains all
    but the tower: gradients 4 B (float32 accumulators), optimizer 4 B master + 8 B Adam, / 4."""
    layer = (3584**2 + 3584) + 2 * (3584 * 512 + 512) + 3584**2 + 3 * 3584 * 18944 + 2 * 3584 + 64
    block = 4 * 1280 + (3 * 1280**2 + 3 * 1280) + (1280**2 + 1280) + 2 * (1280 * 5120) + 5120 + 1280
    tower = 1280 * 3 * 2 * 14 * 14 + 32 * block + 2 * 1280 + (5120**2 + 5120) + (5120 * 3584 + 3584)
    embedding = 152064 * 3584 + 64 + 20
    trained = 7 * layer + embedding
    costs = config_costs(_shape("qwen2-vl-7b"), Workload(seq=1024, image_tokens=256, dtype="bfloat16"))
    got = predict(costs, 4, 8, Candidate("baseline", "even", 1, 8), dp=4, zero=True)
    assert got.layers == (7, 7, 7, 7)
    assert got.parts[0]["parameters"] == 2 * (trained + tower)
    assert got.parts[0]["gradients"] == 4 * trained
    assert got.parts[0]["optimizer"] == 12 * trained // 4
    unsharded = predict(costs, 4, 8, Candidate("baseline", "even", 1, 8), dp=4)
    assert unsharded.parts[0]["optimizer"] == 12 * trained
    assert unsharded.peak_bytes[0] - got.peak_bytes[0] == 12 * trained - 12 * trained // 4


def test_float32_has_no_master_copy() -> None:
    """float32 parameters: 4 B each, gradients 4 B, Adam 8 B and no master copy."""
    shape = _shape("qwen2-vl-2b")
    costs = config_costs(shape, Workload(seq=512, image_tokens=0, dtype="float32"))
    got = predict(costs, 4, 4, Candidate("baseline", "even", 1, 4))
    assert got.parts[1]["optimizer"] == 2 * got.parts[1]["gradients"] == 2 * got.parts[1]["parameters"]


def test_the_cli_prints_the_plans_the_split_and_no_step_time(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "tune",
            "--config",
            str(CONFIGS / "qwen2-vl-72b"),
            "--ranks",
            "8",
            "--dp",
            "4",
            "--zero",
            "1",
            "--top",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "73,405,565,524 parameters" in out
    assert "parameters" in out and "gradients" in out and "optimizer" in out and "activations" in out
    assert "step time: out of reach" in out
    assert "hand check, plan 1, rank 0" in out


def test_a_family_the_split_does_not_know_names_the_ones_it_knows(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 8}))
    assert main(["tune", "--config", str(tmp_path), "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "'mistral'" in err and "llama, qwen2, qwen2_vl" in err
    with pytest.raises(ConfigError, match="hidden_size"):
        model_shape({"model_type": "llama", "hidden_size": 0})


def test_a_budget_nothing_fits_names_the_smallest_peak_and_its_plan(capsys) -> None:
    code = main(
        ["tune", "--config", str(CONFIGS / "qwen2-vl-72b"), "--ranks", "4", "--memory-budget", "64GiB"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "no plan fits" in err and "the smallest predicted peak is" in err and "recompute=on" in err


def test_zero_with_one_replica_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--config", str(CONFIGS / "qwen2-vl-2b"), "--ranks", "2", "--zero", "1"])
    err = capsys.readouterr().err
    assert "--zero 1" in err and "--dp 1" in err
    costs = config_costs(_shape("qwen2-vl-2b"), Workload(seq=256, image_tokens=0))
    with pytest.raises(ValueError, match="dp=1"):
        tune(costs, 2, 4, dp=1, zero=True)


def test_a_language_model_counts_as_published_and_plans_at_one_rank() -> None:
    """Llama-2-7B's sizes give its published 6,738,415,616 parameters; a language model's
    trainable embedding is MPipe's preprocess, and at P = 1 no rank can own its backward, so no
    ``backward="owner"`` candidate is made (it used to be, and the plan refused it)."""
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
    }
    shape = model_shape(config)
    assert param_counts(shape).total == 6_738_415_616
    results = tune(config_costs(shape, Workload(seq=512, image_tokens=0)), 1, 2)
    assert results and all(p.candidate.backward == "central" for p in results)
