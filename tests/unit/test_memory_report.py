"""The predicted peak in ``graph-exec simulate`` and the measured memory lines of ``run``/``bench``."""

from __future__ import annotations

import pytest

from graph_exec.cli import main
from graph_exec.report.memory import memory_line, size_text
from graph_exec.report.records import RankRecord, read_run


def test_simulate_prints_each_ranks_predicted_peak_counts_and_bytes(capsys: pytest.CaptureFixture) -> None:
    # Interleaved 1F1B with V = 1 warms up 2 (P - r - 1) forwards: rank r holds 2 (P - r) - 1
    # micro-batches; the last stage only its fused step's. Receives: one stage input at a time.
    assert main(["simulate", "--pp", "4", "--micro", "8", "--preprocess", "none",
                 "--held-bytes", "100", "--act-bytes", "10"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    block = out[out.index("predicted peak held per rank") :].splitlines()[1:]
    assert [line.split(";")[0] for line in block] == [
        "rank 0: activations 7, receives 1",
        "rank 1: activations 5, receives 7",
        "rank 2: activations 3, receives 5",
        "rank 3: activations 1, receives 1",
    ]
    assert block[0].endswith("; 710 bytes") and block[3].endswith("; 110 bytes")


def test_simulate_without_sizes_prints_counts_only_and_refuses_a_wrong_number_of_sizes(
    capsys: pytest.CaptureFixture,
) -> None:
    assert main(["simulate", "--pp", "2", "--micro", "4", "--preprocess", "frozen"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rank0 = next(line for line in lines if line.startswith("rank 0: activations"))
    assert "preprocess outputs" in rank0 and "bytes" not in rank0
    with pytest.raises(SystemExit):
        main(["simulate", "--pp", "2", "--vpp", "2", "--held-bytes", "1,2,3"])
    assert "--held-bytes has 3 values but the plan has 4 stages" in capsys.readouterr().err


MEMORY = {
    "parameters": 3 * 2**20,
    "gradient_accumulators": 3 * 2**20,
    "optimizer_state": None,
    "activations": 1536,
    "receive_slots": 64,
    "preprocess_outputs": 0,
    "preprocess_tapes": 0,
    "held_weight_gradients": 0,
    "activations_per_stage": {0: 1024, 2: 512},
    "activation_bytes_per_micro": {0: 512, 2: 256},
    "held_peak": 1600,
    "peak_rss": 5 * 2**30,
    "allocator_peak": None,
}


def test_a_memory_line_names_every_part_in_binary_units() -> None:
    line = memory_line(1, MEMORY)
    assert line == (
        "rank 1: params 3.0 MiB, grads 3.0 MiB, optimizer not seen, activations 1.5 KiB "
        "(per stage 0: 1.0 KiB, 2: 512 B), receives 64 B, preprocess outputs 0 B, held peak 1.6 KiB; "
        "peak RSS 5.0 GiB"
    )
    assert memory_line(0, {**MEMORY, "allocator_peak": 2**30}).endswith("allocator peak 1.0 GiB")
    assert size_text(None) == "-" and size_text(1023) == "1023 B"


def test_the_record_carries_the_memory_through_json(tmp_path) -> None:
    RankRecord("run", 0, 1, (), memory=MEMORY).write(tmp_path)
    (back,) = read_run(tmp_path, "run", 1)
    assert back.memory["activations"] == 1536
    assert back.memory["activations_per_stage"] == {"0": 1024, "2": 512}  # JSON keys are text
