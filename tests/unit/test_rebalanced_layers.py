"""The rebalanced baseline's split (graph_exec.balance): pure arithmetic, no MindSpore."""

import itertools

import pytest

from graph_exec.balance import rank_loads, rebalanced_layers


def best_max_load(num_layers, pp, layer_cost, extra):
    """The smallest largest rank load over every way of giving whole layers to ranks."""
    best = float("inf")
    for counts in itertools.product(range(num_layers + 1), repeat=pp):
        if sum(counts) == num_layers:
            best = min(best, max(c * layer_cost + e for c, e in zip(counts, extra, strict=True)))
    return best


@pytest.mark.parametrize("tower", [0.0, 0.5, 1.0, 2.5, 4.0, 20.0])
@pytest.mark.parametrize(("layers", "pp", "vpp"), [(8, 2, 2), (12, 3, 2), (16, 4, 2), (7, 2, 1)])
def test_the_largest_rank_load_is_the_smallest_whole_layers_allow(tower, layers, pp, vpp):
    extra = [tower] + [0.0] * (pp - 1)
    split = rebalanced_layers(layers, pp, vpp, layer_cost=1.0, rank_extra=extra)
    assert len(split) == pp * vpp and sum(split) == layers and min(split) >= 0
    assert max(rank_loads(split, pp, 1.0, extra)) == pytest.approx(best_max_load(layers, pp, 1.0, extra))


def test_no_tower_gives_the_even_split_and_a_tower_takes_layers_from_rank_0():
    assert rebalanced_layers(8, 2, 2, 1.0) == (2, 2, 2, 2)
    assert rebalanced_layers(8, 2, 2, 1.0, [2.0]) == (1, 2, 2, 3)  # rank 0: 3 layers + tower 2 = 5
    assert rebalanced_layers(8, 2, 2, 3.0, [7.0]) == (1, 2, 2, 3)  # tower worth 2.3 layers
    assert rebalanced_layers(4, 2, 2, 1.0, [10.0]) == (0, 2, 0, 2)  # all layers leave rank 0


def test_the_last_rank_extra_counts_too():
    assert rebalanced_layers(8, 2, 2, 1.0, [2.0, 2.0]) == (2, 2, 2, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 0, 2, 1.0), "pp must be an integer >= 1, got 0"),
        ((8, 2, 2, 0.0), "layer_cost must be > 0"),
        ((8, 2, 2, 1.0, [1.0, 1.0, 1.0]), "rank_extra must hold at most pp=2 numbers >= 0"),
        ((-1, 2, 2, 1.0), "num_layers must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        rebalanced_layers(*args)
