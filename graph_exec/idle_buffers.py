"""Idle buffers kept for reuse by key, bounded in bytes: the least recently given back goes first.

The transport keeps send frames per exact layout and the device receive slots per exact byte
count, so that a step of the same shapes as the last allocates nothing. When shapes change
from step to step every new shape adds buffers of its own; without a bound a whole run's worth
of shapes stays reserved (host memory on CPU, device memory on an accelerator). This cache
holds only *idle* buffers, each one given back by its user once nothing reads or writes it any
more (or with a fence that says when): a buffer in use is never in here, so an eviction never
frees memory an in-flight send or receive uses. Past ``max_bytes`` the buffers given back
longest ago are dropped, each handed to ``evict`` first (a device slot waits there for its
fence). ``docs/architecture.md`` ("Caches and their bounds") lists every cache and its bound.

Kept free of MindSpore and of other package modules (but :mod:`graph_exec.checks`) so the
transport and the runtime may both use it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from graph_exec import checks

T = TypeVar("T")

#: Idle bytes a rank keeps per buffer cache by default: far above what a static-shape step of a
#: small model reuses, small beside an accelerator's memory. ``buffer_cache_bytes`` sets it.
DEFAULT_BUFFER_CACHE_BYTES = 1 << 30


class IdleBuffers(Generic[T]):
    """``key -> idle buffers``, at most ``max_bytes`` in all, least recently given back evicted first.

    :meth:`take` returns the most recently given back buffer of a key (its memory is the most
    likely still warm), :meth:`give` keeps one and evicts beyond the bound. ``max_bytes=0``
    keeps nothing (every buffer is made anew).
    """

    def __init__(self, max_bytes: int, evict: Callable[[T], None] | None = None) -> None:
        self.max_bytes = checks.non_negative_int("buffer_cache_bytes", max_bytes)
        self._evict = evict
        self._order: OrderedDict[int, tuple[Hashable, T, int]] = OrderedDict()  # by give order
        self._by_key: dict[Hashable, deque[int]] = {}
        self._tokens = itertools.count()
        #: Bytes of the idle buffers kept now.
        self.nbytes = 0
        #: Buffers dropped because the bound was reached, and their bytes.
        self.evictions = 0
        self.evicted_bytes = 0

    def take(self, key: Hashable) -> T | None:
        """The most recently given back idle buffer of ``key`` (no longer kept), or ``None``."""
        tokens = self._by_key.get(key)
        if not tokens:
            return None
        token = tokens.pop()
        if not tokens:
            del self._by_key[key]
        _, buffer, nbytes = self._order.pop(token)
        self.nbytes -= nbytes
        return buffer

    def give(self, key: Hashable, buffer: T, nbytes: int) -> None:
        """Keep ``buffer`` (idle now, ``nbytes`` of memory) under ``key``; evict past the bound."""
        token = next(self._tokens)
        self._order[token] = (key, buffer, nbytes)
        self._by_key.setdefault(key, deque()).append(token)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        # Tokens grow with every give and take pops a key's newest, so the oldest kept buffer
        # overall is also the oldest of its key: the left end of that key's deque.
        _, (key, buffer, nbytes) = self._order.popitem(last=False)
        tokens = self._by_key[key]
        tokens.popleft()
        if not tokens:
            del self._by_key[key]
        self.nbytes -= nbytes
        self.evictions += 1
        self.evicted_bytes += nbytes
        if self._evict is not None:
            self._evict(buffer)

    def __len__(self) -> int:
        return len(self._order)

    def buffers(self) -> list[T]:
        """The idle buffers kept, least recently given back first."""
        return [buffer for _, buffer, _ in self._order.values()]

    def stats(self) -> dict[str, Any]:
        """What ``stats()["memory"]["caches"]`` shows of this cache: idle ``entries`` and ``bytes``,
        the bound ``max_bytes`` and the ``evictions`` (with ``evicted_bytes``) so far."""
        return {
            "entries": len(self._order),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
        }
