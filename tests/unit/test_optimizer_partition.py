"""The ZeRO-1 partition (graph_exec/runtime/optimizer_sharding.py): balanced by bytes, the same
answer on every replica whatever order it sees the parameters in, whole parameters only."""

from __future__ import annotations

import random

import pytest

from graph_exec.runtime.optimizer_sharding import partition_by_bytes


def loads(sizes: list[tuple[str, int]], owners: list[int], parts: int) -> list[int]:
    out = [0] * parts
    for (_, nbytes), owner in zip(sizes, owners, strict=True):
        out[owner] += nbytes
    return out


def transformer_like() -> list[tuple[str, int]]:
    """An embedding, 6 layers of four matrices, two norms and biases each, and a head."""
    sizes = [("embed.weight", 4 * 1000 * 64)]
    for layer in range(6):
        sizes += [(f"layers.{layer}.{m}.weight", 4 * 64 * 64) for m in ("q", "k", "v", "o")]
        sizes += [(f"layers.{layer}.mlp.weight", 4 * 64 * 256), (f"layers.{layer}.mlp.bias", 4 * 256)]
        sizes += [(f"layers.{layer}.norm{n}.weight", 4 * 64) for n in (1, 2)]
    return [*sizes, ("head.weight", 4 * 64 * 1000)]


@pytest.mark.parametrize("parts", [2, 3, 4, 8])
def test_each_share_is_within_one_parameter_of_the_mean(parts: int) -> None:
    sizes = transformer_like()
    owners = partition_by_bytes(sizes, parts)
    shares = loads(sizes, owners, parts)
    largest = max(n for _, n in sizes)
    mean = sum(shares) / parts
    assert sum(shares) == sum(n for _, n in sizes)
    assert all(abs(share - mean) <= largest for share in shares), shares
    assert set(owners) == set(range(parts))  # every replica owns something


def test_the_answer_does_not_depend_on_the_order_the_parameters_come_in() -> None:
    sizes = transformer_like()
    expected = dict(zip((n for n, _ in sizes), partition_by_bytes(sizes, 4), strict=True))
    shuffled = list(sizes)
    random.Random(3).shuffle(shuffled)
    got = dict(zip((n for n, _ in shuffled), partition_by_bytes(shuffled, 4), strict=True))
    assert got == expected


def test_equal_sizes_alternate_by_name_and_the_largest_goes_first() -> None:
    sizes = [("b", 8), ("a", 8), ("d", 8), ("c", 8), ("big", 100)]
    # big -> 0; then a, b, c, d (name order) each to the lighter owner: 1, 1, 1, 1 until it passes 0
    assert partition_by_bytes(sizes, 2) == [1, 1, 1, 1, 0]
    assert partition_by_bytes([("x", 4), ("y", 4)], 2) == [0, 1]


def test_one_part_owns_everything() -> None:
    assert partition_by_bytes([("a", 1), ("b", 2)], 1) == [0, 0]


@pytest.mark.parametrize("parts", [0, -1, True, 2.0])
def test_bad_part_counts_are_refused(parts) -> None:
    with pytest.raises(ValueError, match=r"parts must be a positive int"):
        partition_by_bytes([("a", 1)], parts)


def test_repeated_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"names must be unique"):
        partition_by_bytes([("a", 1), ("a", 2)], 2)


def test_the_partition_imports_no_mindspore() -> None:
    """The memory model prices ZeRO from this module's arithmetic, without MindSpore."""
    import subprocess
    import sys

    code = "import sys, graph_exec.runtime.optimizer_sharding; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
