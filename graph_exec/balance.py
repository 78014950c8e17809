"""The rebalanced baseline's split: fewer decoder layers on the rank that also runs the tower.

Without MPipe a vision-language model runs its vision tower on rank 0, right before stage 0:
rank 0 then does more work per micro-batch than the others and the pipeline runs at its pace.
What Megatron-style VLM trainers do instead is an *uneven first stage*: give rank 0's stages
fewer decoder layers, so that tower + layers on rank 0 cost about what the layers of every
other rank cost. :func:`rebalanced_layers` computes that split from measured costs; it is the
strongest baseline MPipe is compared with (``graph-exec bench qwen2vl --tower-ratio``).

Pure arithmetic (no MindSpore): costs in any unit, per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence


def even_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Decoder layers per stage, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if k < extra else 0) for k in range(num_stages))


def rank_loads(
    layers: Sequence[int], pp: int, layer_cost: float, rank_extra: Sequence[float] = ()
) -> tuple[float, ...]:
    """Per-rank work of a split: its stages' layers (stage ``s`` on rank ``s mod pp``) times
    ``layer_cost``, plus ``rank_extra[r]``."""
    extra = list(rank_extra) + [0.0] * (pp - len(rank_extra))
    loads = [float(extra[r]) for r in range(pp)]
    for stage, count in enumerate(layers):
        loads[stage % pp] += count * layer_cost
    return tuple(loads)


def rebalanced_layers(
    num_layers: int, pp: int, vpp: int, layer_cost: float, rank_extra: Sequence[float] = ()
) -> tuple[int, ...]:
    """Decoder layers of each of the ``pp × vpp`` stages, so that the ranks' loads (see
    :func:`rank_loads`) are as equal as whole layers allow: the largest load is the smallest
    any split reaches.

    ``layer_cost`` is one decoder layer's forward + backward per micro-batch; ``rank_extra[r]``
    the other work of rank ``r`` per micro-batch (rank 0: the tower's forward, and its backward
    when trained; the last rank: the head and loss), missing entries 0. Each layer goes to the
    rank that would carry the least after taking it (ties: the later rank, so that rank 0 gets
    no more than it must); the layers of a rank are then spread evenly over its ``vpp`` stages,
    the earlier stages taking fewer. A stage may end with no layer at all.
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < (0 if name == "num_layers" else 1)
        ):
            raise ValueError(
                f"{name} must be an integer >= {0 if name == 'num_layers' else 1}, got {value!r}"
            )
    if not layer_cost > 0:
        raise ValueError(f"layer_cost must be > 0, got {layer_cost!r}")
    if len(rank_extra) > pp or any(not e >= 0 for e in rank_extra):
        raise ValueError(f"rank_extra must hold at most pp={pp} numbers >= 0, got {list(rank_extra)}")
    loads = list(rank_loads((), pp, layer_cost, rank_extra))
    per_rank = [0] * pp
    for _ in range(num_layers):
        rank = min(range(pp), key=lambda r: (loads[r] + layer_cost, -r))
        per_rank[rank] += 1
        loads[rank] += layer_cost
    layers = [0] * (pp * vpp)
    for rank, count in enumerate(per_rank):
        base, extra = divmod(count, vpp)
        for k in range(vpp):
            layers[rank + k * pp] = base + (1 if k >= vpp - extra else 0)
    return tuple(layers)
