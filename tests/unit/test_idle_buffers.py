"""The bounded idle-buffer cache behind the send frames and receive slots: least recently given
back evicted first, counted in entries and bytes, the evicted buffer handed to ``evict``."""

from __future__ import annotations

import pytest

from graph_exec.idle_buffers import IdleBuffers


def test_take_returns_the_most_recently_given_back_buffer_of_its_key() -> None:
    cache: IdleBuffers[str] = IdleBuffers(100)
    cache.give("k", "first", 10)
    cache.give("other", "x", 10)
    cache.give("k", "second", 10)
    assert cache.take("k") == "second" and cache.take("k") == "first" and cache.take("k") is None
    assert cache.take("missing") is None
    assert (len(cache), cache.nbytes) == (1, 10)


def test_past_the_bound_the_least_recently_given_back_goes_first() -> None:
    evicted: list[str] = []
    cache: IdleBuffers[str] = IdleBuffers(30, evicted.append)
    for name, key in [("a", 1), ("b", 2), ("c", 1)]:
        cache.give(key, name, 10)
    assert evicted == [] and cache.nbytes == 30
    assert cache.take(2) == "b"  # taken, then given back: now the most recent
    cache.give(2, "b", 10)
    cache.give(3, "d", 10)  # 40 > 30: "a" (key 1's oldest) goes, "c" of the same key stays
    assert evicted == ["a"] and cache.buffers() == ["c", "b", "d"]
    cache.give(4, "e", 25)  # 55 > 30: "c", "b" and "d" go, oldest first
    assert evicted == ["a", "c", "b", "d"] and cache.buffers() == ["e"]
    assert cache.take(1) is None and cache.take(4) == "e"
    assert cache.stats() == {"entries": 0, "bytes": 0, "max_bytes": 30, "evictions": 4, "evicted_bytes": 40}


def test_a_buffer_above_the_bound_is_not_kept_and_zero_keeps_nothing() -> None:
    evicted: list[str] = []
    cache: IdleBuffers[str] = IdleBuffers(0, evicted.append)
    cache.give("k", "a", 1)
    assert evicted == ["a"] and len(cache) == 0 and cache.nbytes == 0
    big: IdleBuffers[str] = IdleBuffers(8)
    big.give("k", "small", 8)
    big.give("j", "large", 9)  # evicts "small", then itself
    assert len(big) == 0 and (big.evictions, big.evicted_bytes) == (2, 17)


@pytest.mark.parametrize("bound", [-1, 1.5, True, None, "1"])
def test_the_bound_must_be_a_non_negative_int(bound) -> None:
    with pytest.raises(ValueError, match=f"buffer_cache_bytes must be an int >= 0, got {bound!r}"):
        IdleBuffers(bound)
