"""The tape measured at run time (``measure_tape=True``, issue 53 part 1), on one rank.

A three-stage MLP (stage 1: six Dense(512)+Tanh layers, whose tape keeps each Tanh output) runs one step on one process; ``stats()["memory"]`` must show each stage's measured
tape and a predicted peak that includes what the plan holds of them. Each point runs in a process
of its own: MindSpore's CPU pool keeps freed memory, so a second measurement in the same process
would land in memory the first one freed and see nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RESULT = "@@calibrated "
WIDTH, LAYERS, MICRO = 512, 6, 2


def run_point(rows: int, recompute: bool) -> dict:
    """One step of the MLP with ``rows`` rows per micro-batch; its ``stats()["memory"]`` and plan facts."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    import graph_exec as ge
    from graph_exec.schedule.memory import peak_counts
    from tests.models.common import loss_fn, named

    ms.set_seed(0)
    body = [nn.Dense(WIDTH, WIDTH, activation="tanh") for _ in range(LAYERS)]
    cells = [nn.Dense(64, WIDTH), nn.SequentialCell(body), nn.Dense(WIDTH, 10)]
    stages = [ge.PipelineStage(named(cell, f"s{k}."), k, 3) for k, cell in enumerate(cells)]
    sched = ge.ScheduleInterleaved1F1B(
        stages, MICRO, loss_fn=loss_fn, recompute=recompute, measure_tape=True, mode="pynative"
    )
    x = ms.Tensor(np.random.default_rng(0).standard_normal((MICRO * rows, 64)).astype(np.float32))
    labels = ms.Tensor(np.arange(MICRO * rows, dtype=np.int32) % 10)
    sched.run(x, labels=labels)
    memory = sched.stats()["memory"]
    keys = ("tape_bytes_per_micro", "tape_peak", "base_in_use", "predicted_parts", "predicted_peak")
    keys += ("held_peak", "peak_rss")
    out = {key: memory[key] for key in keys}
    out["activation_bytes_per_micro"] = memory["activation_bytes_per_micro"]
    out["held_forwards"] = peak_counts(sched.plan, 0)["activations"]
    return out


def measure(points: list[tuple[int, bool]]) -> list[dict]:
    """:func:`run_point` of each ``(rows, recompute)`` in a process of its own, all at once."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.test_tape_calibration", str(rows), str(int(rc))],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rows, rc in points
    ]
    out = []
    for run in runs:
        stdout, _ = run.communicate()
        assert run.returncode == 0, run.args
        line = next(x for x in stdout.splitlines() if x.startswith(RESULT))
        out.append(json.loads(line[len(RESULT) :], object_hook=_int_keys))
    return out


def _int_keys(d: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def test_the_tape_is_measured_per_stage_scales_with_the_batch_and_recompute_holds_inputs_only() -> None:
    small, double, recompute = measure([(1024, False), (2048, False), (1024, True)])
    # Stage 1's tape keeps each Tanh output (the next layer's Dense input and its own gradient's
    # factor): rows x 512 floats for each of the first five layers; the sixth's is the stage
    # output, which the library counts itself. Tolerance 20 %: RSS moves in pool blocks.
    by_shapes = (LAYERS - 1) * 1024 * WIDTH * 4
    tape = small["tape_bytes_per_micro"][1]
    assert tape == pytest.approx(by_shapes, rel=0.2), small
    # Twice the rows, twice the tape (20 %).
    assert double["tape_bytes_per_micro"][1] == pytest.approx(2 * tape, rel=0.2), (small, double)
    # The prediction adds each held forward's tape (one rank holds every stage here).
    assert small["tape_peak"] >= tape
    assert small["predicted_peak"] == small["base_in_use"] + small["held_peak"] + small["tape_peak"]
    parts = {"base_in_use": small["base_in_use"], "held": small["held_peak"], "tape": small["tape_peak"]}
    assert small["predicted_parts"] == parts
    # recompute: the executor keeps the stage inputs only (rows x 512 floats for stage 1), and
    # of the tape only the one a backward records again.
    assert recompute["activation_bytes_per_micro"][1] == 1024 * WIDTH * 4
    rc_tapes = recompute["tape_bytes_per_micro"]
    assert recompute["tape_peak"] == max(rc_tapes.values())
    assert rc_tapes[1] == pytest.approx(tape, rel=0.2)
    assert recompute["predicted_peak"] < small["predicted_peak"]


if __name__ == "__main__":
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    print(RESULT + json.dumps(run_point(int(sys.argv[1]), bool(int(sys.argv[2])))), flush=True)
