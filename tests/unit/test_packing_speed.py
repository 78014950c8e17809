"""The packing benchmark's arithmetic (``graph_exec.benchmarks.packing_speed``), on made-up rank
reports: a step's time is the slower rank's, unmeasured (warm-up or compiling) steps count for
no way, and the ratio is set against both ideals."""

from __future__ import annotations

import argparse

import pytest

from graph_exec.benchmarks import packing_speed as ps


def _step(measured: bool, padded_s: float, packed_s: float) -> dict:
    return {
        "measured": measured,
        "padded": {"s": padded_s, "real": 600, "slots": 1200, "spread": 1.5},
        "packed": {"s": packed_s, "real": 600, "slots": 800, "spread": 1.0},
    }


def test_a_launch_is_summarised_from_the_slower_rank_of_its_measured_steps():
    rank0 = [_step(False, 9.0, 9.0), _step(True, 2.0, 1.0), _step(True, 2.0, 1.0)]
    rank1 = [_step(False, 9.0, 9.0), _step(True, 1.0, 1.5), _step(True, 3.0, 0.5)]
    run = ps._summarise([{"rank": 0, "steps": rank0}, {"rank": 1, "steps": rank1}], ("padded", "packed"))
    assert run["padded"]["tokens_s"] == pytest.approx(1200 / (2.0 + 3.0))
    assert run["packed"]["tokens_s"] == pytest.approx(1200 / (1.5 + 1.0))
    assert run["padded"]["padding"] == pytest.approx(0.5) and run["packed"]["padding"] == pytest.approx(0.25)
    assert run["packed"]["ms_per_1k_slots"] == pytest.approx(1e6 * 2.5 / 1600)
    assert run["padded"]["steps"] == 2 and run["packed"]["step_ms"] == pytest.approx(1e3 * 2.5 / 2)
    ratio, ideal, own = ps._ratios(run)
    assert ratio == pytest.approx(2.0) and ideal == pytest.approx(2.0) and own == pytest.approx(1.5)


def test_ways_are_a_subset_named_once():
    assert ps._ways("packed,padded") == ("packed", "padded")
    for bad in ("padded,bogus", "packed,packed"):
        with pytest.raises(
            argparse.ArgumentTypeError, match="comma-separated subset of padded,packed,tokens"
        ):
            ps._ways(bad)


def test_a_bad_width_is_refused_before_anything_launches(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ps.main(["--hidden", "48"])
    assert exit_info.value.code == 2
    assert "--hidden 48: 0 (the preset's) or a positive multiple of 32" in capsys.readouterr().err


def test_the_balance_line_sets_token_only_rows_against_balanced_ones():
    way = {"tokens_s": 1.0, "padding": 0.1, "ms_per_1k_slots": 1.0, "steps": 2}
    run = {
        "packed": {**way, "step_ms": 100.0, "tower": 1.0},
        "tokens": {**way, "step_ms": 125.0, "tower": 1.43},
    }
    assert ps._balance_line(run) == "tokens/packed step time 1.250x (tower max/mean 1.43 against 1.00)"


def test_layers_replace_the_presets_depth_and_reach_the_ranks(monkeypatch):
    from graph_exec.examples import qwen2vl

    default = ps._preset(ps._parser().parse_args([]))
    assert default.layers == qwen2vl.SIZES["tiny"].layers and default.hidden == 256
    deeper = ps._preset(ps._parser().parse_args(["--layers", "2", "--hidden", "1024"]))
    assert (deeper.layers, deeper.hidden, deeper.image) == (2, 1024, default.image)
    launched = []

    def launch(script, args, **kwargs):
        launched.append(args)
        return 3  # as a failed launch: main stops there

    monkeypatch.setattr(ps, "launch_and_report", launch)
    assert ps.main(["--layers", "2", "--repeats", "1"]) == 3
    assert "--layers=2" in launched[0] and "--as-rank" in launched[0]
    assert ps.main(["--repeats", "1"]) == 3
    assert "--layers=0" in launched[1]


@pytest.mark.parametrize("layers", ["1", "-2"])
def test_too_few_layers_are_refused_before_anything_launches(capsys, layers):
    with pytest.raises(SystemExit) as exit_info:
        ps.main(["--layers", layers])
    assert exit_info.value.code == 2
    assert (
        f"--layers {layers}: 0 (the preset's) or at least 2 (one per stage of P = 2)"
        in capsys.readouterr().err
    )
