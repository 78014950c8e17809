"""The tape formula ``tune --config`` prices a layer's activations with, against measurement:
two widths and two lengths of a small Qwen2 layer, each measured in a process of its own
(memory in use grown per held taped forward, minus the same forward without the tape; RSS on
CPU). Tolerance 25 %: RSS moves in allocator blocks, and the formula is a fit of a few
coefficients (docs/memory.md)."""

from __future__ import annotations

import pytest

from graph_exec.config_sizes import layer_tape_bytes
from graph_exec.harness.tape_fit import measure_apart


def test_the_formula_is_within_a_quarter_of_the_measured_tape_at_two_widths_and_two_lengths() -> None:
    points = measure_apart([(128, 256, 128), (256, 512, 128), (128, 256, 256)])
    for point in points:
        predicted = layer_tape_bytes(point.shape(), point.rows, point.seq, 4)
        assert point.measured > 0
        assert predicted == pytest.approx(point.measured, rel=0.25), point
