"""The packing profiler (``graph_exec.benchmarks.packing_profile``): it times every component of
both ways' micro-batches on a small draw, its layer mode sets rows of ``--max-length`` against
padded rows of the same slots, and its estimate of the width where packing reaches 0.8 of the
ideal follows from the measured excess (made-up figures, no timing asserted)."""

from __future__ import annotations

import pytest

from graph_exec.benchmarks import packing_profile as pp

#: A small draw (step 0's two samples fit rows of 400) on a 32-wide model: the smoke is cheap.
SMALL = [
    "--hidden",
    "32",
    "--batch",
    "2",
    "--micro",
    "1",
    "--max-length",
    "400",
    "--steps",
    "0",
    "--reps",
    "1",
]


def _args(*extra: str):
    return pp._parser().parse_args([*SMALL, *extra])


def test_every_component_of_both_ways_is_timed_per_slot():
    table = pp.profile(_args())
    for way in ("padded", "packed"):
        row = table[way]
        assert all(row[part] > 0 for part in pp.PARTS)
        assert 0 < row["real"] <= row["slots"]
    # The draw of step 0 as packing_speed makes it: padded rows are each micro-batch's longest sample.
    assert table["packed"]["slots"] == table["packed"]["rows"] * 400
    assert table["padded"]["rows"] == 2 and table["padded"]["slots"] <= 2 * 400


def test_the_layer_mode_sets_packed_rows_against_padded_rows_of_the_same_slots():
    (row,) = pp.layer(_args("--layer", "--widths", "32", "--rows", "1"))
    assert row["width"] == 32 and 0 < row["padded_length"] <= 400
    assert row["packed_layer"] > 0 and row["packed_attn"] > 0
    assert 0 <= row["pad_packed"] < 1 and 0 <= row["pad_padded"] < 1


def _row(width: float, excess: float) -> dict[str, float]:
    return {"width": width, "pad_packed": 0.08, "padded_layer": 100.0, "packed_layer": 100.0 * (1 + excess)}


def test_the_width_for_the_target_follows_the_fitted_excess():
    assert pp.of_ideal(_row(256, 0.15)) == pytest.approx(0.92 / 1.15)
    # excess 0.4 at 256 halving with every doubling: 0.8 of the ideal needs excess 0.92 / 0.8 - 1 = 0.15
    rows = [_row(256, 0.4), _row(512, 0.2), _row(1024, 0.1)]
    assert pp.width_for(rows) == pytest.approx(256 * 0.4 / 0.15, rel=1e-6)
    assert pp.width_for([_row(256, 0.1), _row(512, 0.2)]) is None  # not falling with the width
