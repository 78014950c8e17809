"""The memory table benchmark's own arithmetic: the calibrated sizes and the verdict."""

from graph_exec.benchmarks.memory_table import activation_sizes, order_verdict, table


def test_a_taped_stage_keeps_inputs_and_outputs_a_recomputed_one_its_inputs_the_last_its_input() -> None:
    ins, outs, taped = [100, 40, 40], [40, 40, 4], [False, True, True]
    assert activation_sizes(ins, outs, taped, recompute=False) == {0: 100, 1: 80, 2: 40}
    assert activation_sizes(ins, outs, taped, recompute=True) == {0: 100, 1: 40, 2: 40}


def row(predicted: int, measured: int) -> dict:
    return {
        "pp": 2,
        "vpp": 1,
        "plan": "fair",
        "rank": 0,
        "predicted": predicted,
        "measured": measured,
        "ratio": measured / predicted,
        "held_peak": measured,
        "parameters": 1,
        "peak_rss": 1,
    }


def test_the_verdict_names_the_largest_error_against_the_target() -> None:
    assert "10.0% (within the 15% target)" in table([row(100, 110), row(100, 95)])
    assert "20.0% (OUTSIDE the 15% target)" in table([row(100, 80)])


def test_plans_swapped_only_within_the_measurement_spread_are_tied_others_are_named() -> None:
    measured = {"rc": 800.0, "full": 1108.0, "min": 1109.0, "zb": 1334.0}
    assert order_verdict({"rc": 700.0, "full": 1000.0, "min": 1010.0, "zb": 1200.0}, measured) == "same order"
    tied = order_verdict({"rc": 700.0, "full": 1010.0, "min": 1000.0, "zb": 1200.0}, measured)
    assert tied == "same order up to ties within 1% measured: full/min"
    swapped = order_verdict({"rc": 1300.0, "full": 1000.0, "min": 1010.0, "zb": 1200.0}, measured)
    assert swapped.startswith("DIFFERENT order") and "rc/zb" in swapped and "full/min" not in swapped
