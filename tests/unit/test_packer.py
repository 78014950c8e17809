"""The packer (``graph_exec.data.packing``): rows within the budget, every sample once, the
micro-batches' tower costs balanced on a skewed mix, deterministic from the seed, and the
bad-input errors. Pure Python (no MindSpore); the numerics of packed rows:
tests/runtime/test_packing.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from graph_exec.data.packing import SampleCost, check_budget, pack, row_buckets_upto, spread
from graph_exec.report import image_mix


def long_tailed_text(rng) -> int:
    """Text of 16..512 tokens, log-uniform (the issue's long-tailed mix)."""
    return int(np.exp(rng.uniform(np.log(16), np.log(512))))


def skewed_mix(micro: int, per_micro: int, step: int) -> list[SampleCost]:
    """The samples of ``bench qwen2vl --image-mix skewed`` at step ``step``: ``micro`` groups of
    ``per_micro`` samples, every sample one image, the samples of the mix's heavy groups
    :data:`~graph_exec.report.image_mix.HEAVY_FACTOR` x the patches of a light one (64); the
    text long-tailed."""
    rng = np.random.default_rng(step)
    costs = []
    for heavy in image_mix.heavy_micros("skewed", micro, step):
        for _ in range(per_micro):
            patches = 64 * (image_mix.HEAVY_FACTOR if heavy else 1)
            image = patches // 4 + 2
            costs.append(SampleCost(long_tailed_text(rng) + image, patches, image))
    return costs


def check_rows(packing, costs, max_length) -> None:
    placed = sorted(i for mb in packing.micro_batches for row in mb for i in row)
    assert placed == list(range(len(costs)))  # every sample exactly once
    for mb in packing.micro_batches:
        assert len(mb) == packing.rows
        for row in mb:
            assert sum(costs[i].tokens for i in row) <= max_length


@pytest.mark.parametrize("step", range(4))
def test_balanced_rows_spread_the_heavy_images(step):
    """The skewed image mix (M = 8, 4 samples per group as the bench draws them, rows of 1024
    tokens): the micro-batches' tower costs max/mean are at most 1.2 with ``balance="tower"``;
    packed by tokens alone, the heavy images bunch (above 1.2 here)."""
    costs = skewed_mix(8, 4, step)
    balanced = pack(costs, 1024, 8, seed=step)
    tokens_only = pack(costs, 1024, 8, balance="tokens", seed=step)
    check_rows(balanced, costs, 1024)
    check_rows(tokens_only, costs, 1024)
    ours, theirs = spread(balanced.tower_costs(costs)), spread(tokens_only.tower_costs(costs))
    assert ours <= 1.2, (ours, balanced.tower_costs(costs))
    assert theirs > 1.2, (theirs, tokens_only.tower_costs(costs))


def test_a_long_tailed_mix_packs_with_little_padding():
    """96 samples of long-tailed text, a fifth with an image: balanced rows stay nearly as
    full as token-only rows (at most one row more per micro-batch, under 30 % padding)."""
    rng = np.random.default_rng(0)
    costs = []
    for k in range(96):
        patches = 64 if k % 5 == 0 else 0
        image = patches // 4 + 2 if patches else 0
        costs.append(SampleCost(long_tailed_text(rng) + image, patches, image))
    balanced = pack(costs, 1024, 4)
    tokens_only = pack(costs, 1024, 4, balance="tokens")
    check_rows(balanced, costs, 1024)
    assert balanced.rows <= tokens_only.rows + 1
    assert balanced.padding_fraction(costs, 1024) < 0.3
    assert spread(balanced.tower_costs(costs)) <= spread(tokens_only.tower_costs(costs))


def test_the_packing_is_deterministic_from_the_seed():
    """The same sizes and seed give the same packing (every rank computes it alone); sizes
    with ties packed with another seed may differ, and still hold every sample once."""
    costs = [SampleCost(10 + (k % 3), 64 * (k % 2)) for k in range(24)]
    first = pack(costs, 64, 4, seed=3)
    assert pack(list(costs), 64, 4, seed=3) == first
    others = {pack(costs, 64, 4, seed=s).micro_batches for s in range(6)}
    assert len(others) > 1
    for s in range(6):
        check_rows(pack(costs, 64, 4, seed=s), costs, 64)


def test_micro_batches_need_not_hold_equal_sample_counts():
    """Five samples into two micro-batches (``vlm_micro_batches`` wants a multiple of M)."""
    costs = [SampleCost(30, 200), SampleCost(10), SampleCost(12), SampleCost(8, 50), SampleCost(9, 50)]
    packing = pack(costs, 64, 2)
    check_rows(packing, costs, 64)
    counts = sorted(sum(len(r) for r in mb) for mb in packing.micro_batches)
    assert counts[0] != counts[1]
    assert sorted(packing.tower_costs(costs)) == [100.0, 200.0]


def test_bad_budgets_name_the_sample_and_the_smallest_budget():
    with pytest.raises(
        ValueError,
        match=r"max_length 40 is below the 66 tokens of sample 1's images: the smallest max_length that holds every sample's images is 66",
    ):
        check_budget([SampleCost(20), SampleCost(70, 256, 66)], 40)
    with pytest.raises(ValueError, match=r"sample 1 has 70 tokens, above max_length 68: cut it"):
        pack([SampleCost(20), SampleCost(70, 256, 66)], 68, 1)
    with pytest.raises(ValueError, match=r"max_length must be a positive int .* got 0"):
        pack([SampleCost(20)], 0, 1)
    with pytest.raises(ValueError, match=r"balance='patches'; choose one of \('tower', 'tokens'\)"):
        pack([SampleCost(20)], 32, 1, balance="patches")
    with pytest.raises(ValueError, match=r"micro must be a positive int .* got 0"):
        pack([SampleCost(20)], 32, 0)


def test_row_buckets_round_the_rows_up_to_few_shapes():
    """Rows per micro-batch are what the packing needs rounded up to the smallest bucket that
    holds them: 16 draws of 8-96 long-tailed samples meet fewer row shapes than without
    buckets, each rounded up by less than half."""
    buckets = row_buckets_upto(16)
    seen, bucketed = set(), set()
    for step in range(16):
        rng = np.random.default_rng(step)
        costs = [SampleCost(long_tailed_text(rng)) for _ in range(int(rng.integers(8, 97)))]
        need = pack(costs, 512, 4, seed=step)
        rounded = pack(costs, 512, 4, seed=step, row_buckets=buckets)
        check_rows(rounded, costs, 512)
        assert rounded.rows == min(b for b in buckets if b >= need.rows)
        assert [[r for r in mb if r] for mb in rounded.micro_batches] == [
            [r for r in mb if r] for mb in need.micro_batches
        ]  # the same rows, only empty ones added
        assert rounded.rows < need.rows * 1.5
        seen.add(need.rows)
        bucketed.add(rounded.rows)
    assert bucketed <= set(buckets) and len(bucketed) < len(seen)


def test_row_buckets_upto_are_powers_of_two_and_halfway():
    assert row_buckets_upto(1) == (1,)
    assert row_buckets_upto(5) == (1, 2, 3, 4, 6)
    assert row_buckets_upto(16) == (1, 2, 3, 4, 6, 8, 12, 16)
    with pytest.raises(ValueError, match=r"most must be a positive int .* got 0"):
        row_buckets_upto(0)


def test_bad_row_buckets_are_named():
    costs = [SampleCost(30), SampleCost(30), SampleCost(30)]
    allowed = r"a non-empty increasing tuple of positive ints \(rows per micro-batch\)"
    for bad in ((), (2, 1), (0, 1), (1, 1, 2), (1.5, 2), "12", (True, 2)):
        with pytest.raises(ValueError, match=rf"row_buckets={re.escape(repr(bad))}: {allowed}"):
            pack(costs, 32, 1, row_buckets=bad)
    with pytest.raises(
        ValueError,
        match=r"3 samples need 3 rows in some micro-batch, above the largest of row_buckets=\(1, 2\): "
        r"add a bucket of at least 3",
    ):
        pack(costs, 32, 1, row_buckets=(1, 2))
    with pytest.raises(ValueError, match=r"give rows=2 or row_buckets=\(1, 2\), not both"):
        pack(costs, 32, 1, rows=2, row_buckets=(1, 2))
