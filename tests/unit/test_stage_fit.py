"""``fit_stages``: a layer's cost told apart from a stage call's fixed part where the launches
hold different layer counts, and a non-negative split that reproduces every stage where they
do not."""

from __future__ import annotations

import pytest

from graph_exec.report.stage_fit import MeasuredSplit, fit_stages
from graph_exec.simulate import OpCosts


def _measured(forward, backward, layers) -> MeasuredSplit:
    return MeasuredSplit(OpCosts(stage_forward=tuple(forward), stage_backward=tuple(backward)), tuple(layers))


def _stages(layers, layer=(1.0, 3.0), chunk=(2.0, 1.5), first=(0.5, 0.25), last=4.0) -> MeasuredSplit:
    """Stages priced by the model of the module docstring."""
    end = len(layers) - 1
    forward = [(first if s == 0 else chunk)[0] + n * layer[0] for s, n in enumerate(layers)]
    backward = [(first if s == 0 else chunk)[1] + n * layer[1] for s, n in enumerate(layers)]
    forward[end], backward[end] = last + layers[end] * sum(layer) - 0.5, 0.5  # fused; the send
    return _measured(forward, backward, layers)


@pytest.mark.parametrize(
    "splits",
    [
        [(1, 1, 1, 1), (2, 2)],  # a V = 1 launch beside the V = 2 one (P = 2)
        [(2, 2, 2, 2, 2, 2, 2, 2), (4, 4, 4, 4)],  # the same at P = 4
        [(1, 2, 3, 2)],  # one uneven split
    ],
)
def test_different_layer_counts_separate_the_layer_from_the_call(splits) -> None:
    got = fit_stages([_stages(s) for s in splits])
    assert (got.layer_forward, got.layer_backward) == (pytest.approx(1.0), pytest.approx(3.0))
    assert (got.chunk_forward, got.chunk_backward) == (pytest.approx(2.0), pytest.approx(1.5))
    assert (got.first_forward, got.first_backward) == (pytest.approx(0.5), pytest.approx(0.25))
    assert got.last_extra == pytest.approx(4.0)


def test_one_layer_count_keeps_every_part_non_negative_and_every_stage() -> None:
    """Stage 0's backward sends nothing back, so it costs less than a middle stage's: the layer
    takes stage 0's per-layer cost (the smaller) and the middle stages' excess is their call's,
    where dividing each stage by its layers would have priced stage 0 a negative extra."""
    got = fit_stages([_measured((2.75, 3.15, 2.65, 4.3), (2.3, 3.2, 2.8, 0.7), (1, 1, 1, 1))])
    assert got.layer_backward == pytest.approx(2.3) and got.first_backward == pytest.approx(0.0)
    assert got.chunk_backward == pytest.approx(0.7)  # (3.2 + 2.8) / 2 - 2.3
    assert got.layer_forward == pytest.approx(2.75) and got.first_forward == pytest.approx(0.0)
    assert got.chunk_forward == pytest.approx(0.15)  # (3.15 + 2.65) / 2 - 2.75
    assert got.last_extra == pytest.approx(0.0)  # 4.3 + 0.7 - (2.75 + 2.3) < 0: clamped
    assert min(vars(got).values()) >= 0


def test_noise_that_fits_a_negative_part_falls_back_to_the_non_negative_split() -> None:
    """Stage 0 with two layers measured cheaper than with one: no non-negative layer fits.

    By hand, per direction (forward and backward measured alike here): stage 0 gives
    ``layer + first = 3.0`` and ``2 layer + first = 2.9``, the middle stages ``layer + chunk =
    3.0``; the exact least-squares answer is ``layer = -0.1`` (refused). The fallback takes the
    smaller group mean of per-layer costs, stage 0's ``(3.0 / 1 + 2.9 / 2) / 2 = 2.225`` (the
    middle stages' is 3.0); then ``chunk = 3.0 - 2.225 = 0.775`` and ``first = ((3.0 - 2.225) +
    (2.9 - 4.45)) / 2 = -0.3875``, clamped to 0. The last stage: ``((5.0 + 0.5 - 1 · 4.45) +
    (9.0 + 0.0 - 2 · 4.45)) / 2 = (1.05 + 0.1) / 2 = 0.575``."""
    got = fit_stages(
        [
            _measured((3.0, 3.0, 3.0, 5.0), (3.0, 3.0, 3.0, 0.5), (1, 1, 1, 1)),
            _measured((2.9, 9), (2.9, 0), (2, 2)),
        ]
    )
    for direction in ("forward", "backward"):
        assert getattr(got, f"layer_{direction}") == pytest.approx(2.225, abs=1e-12)
        assert getattr(got, f"chunk_{direction}") == pytest.approx(0.775, abs=1e-12)
        assert getattr(got, f"first_{direction}") == 0.0
    assert got.last_extra == pytest.approx(0.575, abs=1e-12)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="at least one measured launch"):
        fit_stages([])
    with pytest.raises(ValueError, match=r"split \[4\] and 1 stage costs"):
        fit_stages([_measured((1.0,), (1.0,), (4,))])
