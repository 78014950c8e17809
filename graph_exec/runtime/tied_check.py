"""Tied copies stay one value: their checksums ride in the tied gradients' all-reduce.

The two copies of a tied pair (:mod:`graph_exec.runtime.tied`) start equal and get the same
summed gradient, but the optimizer may still treat them differently: per-group settings (no
weight decay on embeddings, a common choice) move them apart a little every step, and nothing
else would notice. So at the end of every step, before the gradients are summed, each rank that
counts a copy puts a checksum of its *values* into a few float32 slots that travel in the same
all-reduce as the tied gradients (no new collective): ``+checksum`` for the pair's first name,
``-checksum`` for its second, zeros elsewhere. After the sum a slot is exactly zero iff the two
checksums are equal, and every rank sees the same sums, so every rank raises the same
:class:`~graph_exec.errors.TiedCopiesDriftError` naming the pair. The values checked at a step's
end are those the previous ``step()`` left (nothing changes them during ``run()``).

**The checksum is exact and order-free.** A float sum would depend on the reduction order (not
fixed on every accelerator) and miss a small drift. Instead each copy's bits are read as integers
(``Tensor.view``: int32 for float32, int16 for float16 and bfloat16), summed per row in int64,
each row sum reduced modulo the prime :data:`LIMB`; the slots are the sum of those and their sum weighted
by the row index modulo :data:`_ROW_WEIGHTS` (so swapped rows are seen too), each again modulo
:data:`LIMB`. Integer sums do not depend on the order, and values below 2**23 are exact in
float32, as is ``a - b`` for two of them: equal bits give exactly zero. Everything stays on the
device; it costs one pass over each copy per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graph_exec.errors import TiedCopiesDriftError

#: Each checksum is taken modulo this prime below 2**23 (float32 holds every integer below
#: 2**24 exactly; a prime, not 2**23, so the exponent bits above bit 23 count too).
LIMB = 8_388_593
#: Row weights run 1 .. this (their products with a row's residue stay far below 2**63).
_ROW_WEIGHTS = 127
#: Checksums per copy: the plain sum and the row-weighted sum.
SLOTS_PER_PAIR = 2


class TiedCopiesCheck:
    """One rank's side of the check: ``pairs`` (name pairs), ``held``: name -> ``Parameter`` of
    the tied names this rank counts (each name is counted on exactly one rank)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], held: Mapping[str, Any]) -> None:
        import mindspore as ms
        from mindspore import Parameter, ops

        self.pairs = tuple(pairs)
        self._held = dict(held)
        self._weights = {name: _row_weights(param) for name, param in self._held.items()}
        #: The slots that ride in the all-reduce (float32: packed with the tied gradients).
        self.slots = Parameter(
            ops.zeros((SLOTS_PER_PAIR * len(self.pairs),), ms.float32),
            name="tied.checks",
            requires_grad=False,
        )

    def stamp(self) -> None:
        """Write this rank's signed checksums into :attr:`slots` (before the all-reduce)."""
        import mindspore as ms
        from mindspore import ops

        parts = []
        for pair in self.pairs:
            total = ops.zeros((SLOTS_PER_PAIR,), ms.float32)
            for sign, name in zip((1.0, -1.0), pair, strict=True):
                if name in self._held:
                    total = total + sign * self._checksum(name)
            parts.append(total)
        ops.assign(self.slots, ops.cat(parts))

    def verify(self) -> None:
        """After the all-reduce: raise :class:`TiedCopiesDriftError` for the first pair whose
        copies differ (every rank sees the same sums, so every rank raises alike)."""
        sums = self.slots.asnumpy().reshape(len(self.pairs), SLOTS_PER_PAIR)
        for pair, values in zip(self.pairs, sums, strict=True):
            if np.any(values != 0):
                raise TiedCopiesDriftError(
                    f"tied_parameters: {pair[0]!r} and {pair[1]!r} no longer hold the same values "
                    f"(their checksums differ by {values.tolist()}): the optimizer treated the two copies "
                    "differently since the last check (per-group settings such as weight decay on one "
                    "only?). Give both copies the same optimizer settings"
                )

    def _checksum(self, name: str) -> Any:
        """The two checksums of copy ``name`` as a float32 pair (see the module docstring)."""
        import mindspore as ms
        from mindspore import ops

        param = self._held[name]
        bits = ms.int32 if param.dtype == ms.float32 else ms.int16
        rows = param.view(bits).astype(ms.int64).reshape(param.shape[0] if param.ndim else 1, -1)
        residues = rows.sum(axis=1) % LIMB
        plain = residues.sum() % LIMB
        weighted = (residues * self._weights[name]).sum() % LIMB
        return ops.stack([plain, weighted]).astype(ms.float32)


def _row_weights(param: Any) -> Any:
    """Weights 1 .. :data:`_ROW_WEIGHTS` for each row of ``param`` (int64)."""
    import mindspore as ms

    rows = param.shape[0] if param.ndim else 1
    return ms.Tensor(np.arange(rows, dtype=np.int64) % _ROW_WEIGHTS + 1)
