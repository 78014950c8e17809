"""The tape measured at run time (``measure_tape=True``, issue 53 part 1), on one rank.

A three-stage MLP (stage 1: six Dense(512)+Tanh layers, whose tape keeps each Tanh output) runs
one step on one process; ``stats()["memory"]`` must show each stage's measured tape and backward
transient and a predicted peak that includes what the plan holds of them, and calibrating must
change no loss and no gradient. Each point runs in a process
of its own: MindSpore's CPU pool keeps freed memory, so a second measurement in the same process
would land in memory the first one freed and see nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graph_exec.runtime.tape_calibration import KEYS

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
    losses = sched.run(x, labels=labels)
    memory = sched.stats()["memory"]
    out = {key: memory[key] for key in (*KEYS, "held_peak", "peak_rss", "activation_bytes_per_micro")}
    out["held_forwards"] = peak_counts(sched.plan, 0)["activations"]
    # The same step without calibration, on the same cells (after the measurement: memory is
    # not read again): its losses and every gradient must be the calibrated run's, bit for bit.
    plain = ge.ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn, recompute=recompute, mode="pynative")
    plain_losses = plain.run(x, labels=labels)
    grads, plain_grads = sched.grads(), plain.grads()
    out["grad_names"] = sorted(grads)
    out["unequal"] = [
        name
        for name in sorted(grads)
        if not np.array_equal(grads[name].asnumpy(), plain_grads[name].asnumpy())
    ]
    out["losses_equal"] = [float(a.asnumpy()) for a in losses] == [float(b.asnumpy()) for b in plain_losses]
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


def test_the_tape_and_backward_transient_are_measured_per_stage_and_change_no_gradient() -> None:
    small, double, recompute = measure([(1024, False), (2048, False), (1024, True)])
    # Stage 1's tape keeps each Tanh output (the next layer's Dense input and its own gradient's
    # factor): rows x 512 floats for each of the first five layers; the sixth's is the stage
    # output, which the library counts itself. Tolerance 20 %: RSS moves in pool blocks.
    by_shapes = (LAYERS - 1) * 1024 * WIDTH * 4
    tape = small["tape_bytes_per_micro"][1]
    assert tape == pytest.approx(by_shapes, rel=0.2), small
    # Twice the rows, twice the tape (20 %).
    assert double["tape_bytes_per_micro"][1] == pytest.approx(2 * tape, rel=0.2), (small, double)
    # The prediction is a timeline (held, tapes and the running backward's transient, summed
    # step by step): its parts sum to it, and it lies between each part's own peak and the sum
    # of the peaks (one rank holds every stage here).
    assert small["tape_peak"] >= tape
    parts = small["predicted_parts"]
    assert small["predicted_peak"] == sum(parts.values())
    assert parts["base_in_use"] == small["base_in_use"] and parts["tape"] <= small["tape_peak"]
    assert parts["backward_transient"] in small["backward_transient_bytes"].values()
    peaks = [small["held_peak"], small["tape_peak"], max(small["backward_transient_bytes"].values())]
    assert max(peaks) <= small["predicted_peak"] - small["base_in_use"] <= sum(peaks)
    after = small["in_use_after_step"]
    assert small["base_in_use"] < after["first"] == after["last"]  # one step: the first is the last
    # Stage 1's backward transient: something (at least its cotangents), and at most every
    # layer's input gradient, tanh derivative and weight gradient alive at once.
    transient = small["backward_transient_bytes"][1]
    assert 0 < transient <= LAYERS * (2 * 1024 * WIDTH + WIDTH * WIDTH) * 4, small
    # Nothing of the last stage is held between steps (its fused step): no tape measured there.
    assert 2 not in small["tape_bytes_per_micro"] and small["backward_transient_bytes"][2] > 0
    # recompute: the executor keeps the stage inputs only (rows x 512 floats for stage 1), no
    # tape is held or measured; the backward's transient holds the forward it rebuilds.
    assert recompute["activation_bytes_per_micro"][1] == 1024 * WIDTH * 4
    assert recompute["tape_bytes_per_micro"] == {} and recompute["tape_peak"] == 0
    assert recompute["backward_transient_bytes"][1] >= 0.8 * tape + transient * 0.5, recompute
    assert recompute["predicted_peak"] < small["predicted_peak"]
    # Calibrating runs backwards that accumulate into the gradient buffers; they are put back:
    # each point's losses and every gradient equal, bit for bit, those of the same step run
    # again without measure_tape on the same cells.
    for point in (small, double, recompute):
        assert len(point["grad_names"]) == 2 * (LAYERS + 2), point["grad_names"]
        assert point["unequal"] == [] and point["losses_equal"], point


if __name__ == "__main__":
    from graph_exec.msenv import prepare_mindspore

    prepare_mindspore("CPU")
    print(RESULT + json.dumps(run_point(int(sys.argv[1]), bool(int(sys.argv[2])))), flush=True)
