"""``graph-exec bench qwen2vl --image-mix``: the mix's definition by cost, the example's
per-micro-batch tower costs read from its batch, and the command's argument checks (no launch)."""

from __future__ import annotations

import numpy as np
import pytest

from graph_exec.cli import image_mix_bench, jobs, main
from graph_exec.report import image_mix


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was launched")

    monkeypatch.setattr(jobs, "launch", tripwire)
    monkeypatch.setattr(image_mix_bench.sweep_cli, "calibrate", tripwire)


@pytest.mark.parametrize("micro", [4, 8])
def test_skewed_costs_vary_four_fold_heavy_rare_mean_two_chunks(micro: int) -> None:
    for step in range(20):
        weights = image_mix.micro_weights("skewed", micro, step)
        assert len(weights) == micro
        assert image_mix.spread(weights) == pytest.approx(4.0)
        heavy = sum(w > 1 for w in weights)
        assert heavy == micro // 4 and heavy <= micro / 4  # rare: at most one in four
        # a light micro-batch at light_ratio chunk forwards makes the mean MEAN_RATIO (= 2)
        mean = sum(weights) / micro * image_mix.light_ratio("skewed", micro)
        assert mean == pytest.approx(2.0)
    positions = {image_mix.heavy_micros("skewed", micro, step) for step in range(20)}
    assert len(positions) > 1  # the heavy micro-batch moves from step to step
    assert image_mix.heavy_micros("skewed", micro, 3) == image_mix.heavy_micros("skewed", micro, 3)


def test_uniform_is_one_cost_per_micro_batch() -> None:
    for step in range(5):
        assert image_mix.micro_weights("uniform", 8, step) == (1.0,) * 8
    assert image_mix.light_ratio("uniform", 8) == pytest.approx(2.0)


def test_heavy_image_has_four_times_the_patches() -> None:
    (h, w), (lh, lw) = image_mix.heavy_side(16), image_mix.light_side(16)
    assert h * w == 4 * lh * lw
    with pytest.raises(ValueError, match="'spiky'"):
        image_mix.heavy_count("spiky", 4)


def test_example_reads_each_micro_batch_cost_from_its_batch() -> None:
    pytest.importorskip("mindone")
    from graph_exec.examples import qwen2vl

    model = qwen2vl.build(4, image_mix="skewed", mix_micro=4, tower_unit=0.5)
    for step in range(3):
        inputs, _ = model.batch(step, 8)
        want = tuple(0.5 * w for w in image_mix.micro_weights("skewed", 4, step))
        assert model.tower_costs(inputs, 4) == pytest.approx(want)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "vl_tower", "--image-mix", "skewed"], "images of 'qwen2vl', not of 'vl_tower'"),
        (["bench", "qwen2vl", "--image-mix", "skewed", "--ranks", "1"], "at least 2"),
        (["bench", "qwen2vl", "--tower-order", "balanced"], "goes with --image-mix"),
        (["bench", "qwen2vl", "--packing"], "--packing goes with --image-mix"),
        (["bench", "qwen2vl", "--vision-depth", "2"], "--vision-depth goes with --image-mix"),
        (["bench", "qwen2vl", "--image-mix", "skewed", "--vision-depth", "0"], "--vision-depth"),
        (["bench", "qwen2vl", "--image-mix", "skewed", "--tower-order", "fastest"], "'fastest'"),
        (["bench", "qwen2vl", "--image-mix", "skewed", "--tower-ratio", "2"], "drop --tower-ratio"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_packed_runs_report_tokens_per_second_padding_and_spread() -> None:
    """``--packing``: the two packed runs join the launch; their figures come from the measured
    steps' progress lines only (the warm-up step left out) and reach the table."""
    runs = image_mix_bench.mix_runs(("arrival", "balanced"), (1, 1), packing=True)
    packed = [r for r in runs if r.pack_balance]
    assert [(r.name, r.pack_balance, r.tower_order) for r in packed] == [
        ("packed-tower.graph", "tower", "balanced"),
        ("packed-tokens.graph", "tokens", "balanced"),
    ]
    assert not any(r.pack_balance for r in image_mix_bench.mix_runs(("arrival",), (1, 1)))
    quick = image_mix_bench.mix_runs(("balanced",), (1, 1), packing=True, mode="pynative")
    assert {r.mode for r in quick} == {"pynative"} and all(r.name.endswith(".pynative") for r in quick)
    lines = [
        {"run": "packed-tower.graph", "step": 0, "seconds": 9.0, "tokens": {"real": 1, "padded": 9}},
        {"run": "packed-tower.graph", "step": 1, "seconds": 2.0, "tokens": {"real": 300, "padded": 400}}
        | {"tower_spread": 1.25},
        {"run": "packed-tokens.graph", "step": 1, "seconds": 3.0, "tokens": {"real": 300, "padded": 400}}
        | {"tower_spread": 2.5},
        {"run": "mpipe-balanced.graph", "step": 1, "seconds": 1.0},
    ]
    figures = image_mix_bench.packed_figures(lines, warmup=1)
    assert figures == {"packed-tower": (150.0, 0.25, 1.25), "packed-tokens": (100.0, 0.25, 2.5)}


def test_example_packs_the_mix_balanced_by_tower_or_by_tokens() -> None:
    """``build(pack_balance=...)``: the mix's sixteen samples (four heavy) in rows of a heavy and
    a light sample, two rows per micro-batch; rows balanced by tower cost give each micro-batch
    one heavy image, rows by tokens alone put them in two (tower cost max/mean 1.0 against 1.43)."""
    pytest.importorskip("mindone")
    from graph_exec.examples import qwen2vl

    spreads = {}
    for way in ("tower", "tokens"):
        model = qwen2vl.build(2, image_mix="skewed", mix_micro=4, pack_balance=way)
        batches = model.micro_batches(0, 16, 4)
        assert len(batches) == 4 and model.token_loss
        assert {inputs[3].shape for inputs, _ in batches} == {(2, qwen2vl.mix_row_tokens())}
        costs = [model.tower_costs(inputs, 1)[0] for inputs, _ in batches]
        assert max(costs) / (sum(costs) / 4) == pytest.approx(model.tower_spread(0, 16))
        spreads[way] = model.tower_spread(0, 16)
        real, slots = model.token_counts(0, 16)
        assert slots == 4 * 2 * qwen2vl.mix_row_tokens() and 0 < real <= slots
    assert spreads == pytest.approx({"tower": 1.0, "tokens": 10 / 7})


def test_packed_tower_costs_count_what_the_padded_rows_compute() -> None:
    """A packed micro-batch's tower runs every row padded to its fullest row's patches, so
    ``run --packing`` places it by rows × that row's real patches (``patch_image >= 0``), not by
    the real patches: two micro-batches of two rows, 3 + 1 and 2 + 2 real patches, compute 6 and
    4 patch slots (the real patches are 4 and 4)."""
    pytest.importorskip("mindone")
    from graph_exec.examples import qwen2vl

    patch_image = np.array([[0, 0, 1, -1], [0, -1, -1, -1], [0, 0, -1, -1], [0, 1, -1, -1]])
    assert qwen2vl.packed_tower_work(patch_image, 2).tolist() == [6, 4]
    assert qwen2vl.packed_tower_work(patch_image, 1).tolist() == [12]
