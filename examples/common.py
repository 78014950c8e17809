"""What every runnable example provides, so ``graph-exec run`` and ``bench`` can drive any of them.

An example builds its whole model split into ``num_stages`` body chunks plus the replicated
preprocess block, and makes synthetic batches that are identical on every rank (each rank
seeds the generator with the step number). The fair baseline MPipe is measured against runs
the same stages and preprocess with ``ScheduleInterleaved1F1B`` (nothing transposed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, nn


@dataclass
class ExampleModel:
    """A model ready to be pipelined, and its data."""

    preprocess: nn.Cell | None
    num_transpose_layers: int
    stages: list[nn.Cell]
    loss_fn: Callable[..., Tensor]
    make_batch: Callable[..., tuple[tuple[Tensor, ...], Tensor]]
    summary: str
    #: ``loss_fn`` with a padding mask after the labels (for ``shapes="buckets"``), if it has one.
    masked_loss_fn: Callable[..., Tensor] | None = None
    #: The ``graph_exec.models.SplitModel`` of a mindone example (what an export writes).
    split: Any = None
    #: ``tower_costs(inputs, micro)``: each micro-batch's preprocess cost in chunk forwards, read
    #: from the batch (what ``tower_order="balanced"`` places by); ``None``: not known.
    tower_costs: Callable[[Sequence[Any], int], tuple[float, ...]] | None = None
    #: ``token_counts(step, batch_size)``: ``(real, padded)`` tokens of that step's global batch
    #: (real-data examples; the step line's real tokens per second and padding fraction).
    token_counts: Callable[[int, int], tuple[int, int] | None] | None = None
    #: ``micro_batches(step, batch_size, micro)``: step ``step``'s batch as ``micro`` micro-batches,
    #: each padded only to its own sizes (``run(micro_batches=...)``: a micro-batch of small images
    #: runs the tower at its own patch count); ``None``: the batch is padded as a whole.
    micro_batches: Callable[[int, int, int], list[tuple[tuple[Tensor, ...], Tensor]]] | None = None
    #: The step's loss is the mean over every labelled token of the global batch
    #: (``causal_lm_token_loss``, ``loss_reduction="token"``), not the mean of the micro-batches'
    #: means: real-data examples, so that packed and padded batches give the same loss.
    token_loss: bool = False
    #: ``tower_spread(step, batch_size)``: max/mean of that step's micro-batches' tower costs
    #: (packed real data; the step line prints it), once its micro-batches were made.
    tower_spread: Callable[[int, int], float | None] | None = None
    #: ``micro_batches`` also takes ``replica=`` and ``replicas=`` and makes that data-parallel
    #: replica's micro-batches of its shard of the global batch (packed rows), their shapes the
    #: same on every replica; ``False``: ``micro_batches`` needs one pipeline.
    shards_micro_batches: bool = False

    def batch(
        self, step: int, batch_size: int, length: int | None = None
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """``(inputs, labels)`` of training step ``step`` (the same on every rank); ``length``:
        the sequence length, for the examples whose ``make_batch`` takes one (``embed_lm``)."""
        if length is None:
            return self.make_batch(step, batch_size)
        return self.make_batch(step, batch_size, length)

    @classmethod
    def of_split(cls, split: Any, make_batch: Callable[[int, int], Any], summary: str) -> ExampleModel:
        """A causal LM cut by :func:`graph_exec.models.split_model` (its ``SplitModel``)."""
        from graph_exec.models import causal_lm_loss

        return cls(
            split.preprocess,
            split.num_transpose_layers,
            split.stages,
            causal_lm_loss,
            make_batch,
            summary,
            split=split,
        )


@dataclass(frozen=True)
class Example:
    """A named model family: ``build(num_stages, trainable_preprocess, seed)``."""

    name: str
    description: str
    build: Callable[..., ExampleModel]
    #: Whether the preprocess is trainable by default (``--frozen``/``--trainable`` override).
    trainable_by_default: bool


class ConversationSource:
    """``graph-exec run --dataset``'s data: the conversations of a file prepared by a model
    directory's own processor (:class:`graph_exec.data.ConversationDataset`); step ``k`` takes
    samples ``k·batch_size …`` in file order, wrapping around (the same on every rank)."""

    def __init__(self, data: Any, summary: str) -> None:
        self.data, self.summary = data, summary
        self._counts: dict[tuple[int, int], tuple[int, int]] = {}  # the last step's only
        self._spread: dict[tuple[int, int], float] = {}  # the last packed step's only

    def samples(self, step: int, batch_size: int) -> list[dict]:
        """Step ``step``'s samples; their token counts are kept for :meth:`token_counts`."""
        made = [self.data[(step * batch_size + k) % len(self.data)] for k in range(batch_size)]
        lengths = [len(sample["input_ids"]) for sample in made]
        self._counts = {(step, batch_size): (sum(lengths), len(lengths) * max(lengths, default=0))}
        return made

    def packed(
        self,
        step: int,
        batch_size: int,
        micro: int,
        max_length: int,
        costs_of: Callable[[list[dict]], list],
        make: Callable[[list[dict], Any], list],
        *,
        replica: int = 0,
        replicas: int = 1,
        balance: str = "tower",
    ) -> list:
        """Replica ``replica``'s shard of step ``step``'s samples (``batch_size // replicas``
        consecutive samples of the global batch) packed into ``micro`` micro-batches of rows of
        ``max_length`` tokens (:func:`graph_exec.data.pack` with ``balance``, by default by tower
        cost, seeded by the step and the replica), made into micro-batches by ``make(samples, packing)``.

        The rows are ragged (``pack(..., ragged=True)``): each micro-batch keeps the rows it holds,
        rounded up to a bucket of :func:`graph_exec.data.row_buckets_upto` (1, 2, 3, 4, 6, 8, ...)
        so a run meets few row shapes (in graph mode each compiles); ``run(micro_batches=...)``
        takes micro-batches of different row counts, and replicas exchange only gradients and
        token counts, so no replica pads to another's rows. Every rank holds the whole global
        batch (replicated input) and packs every replica's shard from the sizes alone: the global
        batch's real tokens and row slots are kept for :meth:`token_counts`, the spread of every
        micro-batch's tower work (``Packing.tower_work``: rows × the fullest row's patches, what
        each packed tower computes) for :meth:`tower_spread`."""
        from graph_exec.data import pack, row_buckets_upto, spread

        if replicas < 1 or not 0 <= replica < replicas or batch_size % replicas:
            raise ValueError(
                f"replica {replica} of {replicas}: the global batch of {batch_size} samples must split "
                "evenly into the replicas' shards (0 <= replica < replicas)"
            )
        made = self.samples(step, batch_size)
        share = batch_size // replicas
        shards = [made[r * share : (r + 1) * share] for r in range(replicas)]
        costs = [costs_of(shard) for shard in shards]
        seeds = [step * replicas + r for r in range(replicas)]
        buckets = row_buckets_upto(max(share, 1))
        packings = [
            pack(c, max_length, micro, balance=balance, seed=k, ragged=True, row_buckets=buckets)
            for c, k in zip(costs, seeds, strict=True)
        ]
        real = sum(c.tokens for shard in costs for c in shard)
        slots = sum(sum(p.row_counts) for p in packings) * max_length
        self._counts = {(step, batch_size): (real, slots)}
        towers = [t for p, c in zip(packings, costs, strict=True) for t in p.tower_work(c)]
        self._spread = {(step, batch_size): spread(towers)}
        return make(shards[replica], packings[replica])

    def tower_spread(self, step: int, batch_size: int) -> float | None:
        """max/mean of the micro-batches' tower work (rows × the fullest row's patches) of packed
        step ``step`` (else ``None``)."""
        return self._spread.get((step, batch_size))

    def token_counts(self, step: int, batch_size: int) -> tuple[int, int] | None:
        """``(real, padded)`` tokens of step ``step``'s batch padded to its longest sample (what
        the step line's real tokens per second and padding fraction come from), once its
        samples were made; else ``None``."""
        return self._counts.get((step, batch_size))


class GeneratedSource(ConversationSource):
    """Samples made per step by ``make(step, batch_size)`` (the bench's image mix) instead of
    read from a file: packed and reported as a :class:`ConversationSource`'s are."""

    def __init__(self, make: Callable[[int, int], list[dict]], summary: str) -> None:
        super().__init__(None, summary)
        self._make = make

    def samples(self, step: int, batch_size: int) -> list[dict]:
        return self._make(step, batch_size)


def conversation_samples(
    dataset: str,
    model_dir: str | None,
    *,
    image_root: str | None = None,
    max_length: int | None = None,
    truncate: bool = False,
    skip_bad_samples: bool = False,
) -> ConversationSource:
    """The :class:`ConversationSource` of ``dataset`` prepared by ``model_dir``'s own processor
    (a sample above ``max_length`` is cut with ``truncate``, else refused, or skipped and named
    with ``skip_bad_samples``)."""
    from graph_exec.data import ConversationDataset

    if model_dir is None:
        raise ValueError("dataset needs pretrained=DIR: the directory's processor prepares the conversations")
    data = ConversationDataset(
        dataset,
        model_dir,
        image_root=image_root,
        max_length=max_length,
        truncate=truncate,
        skip_bad_samples=skip_bad_samples,
    )
    longer = "cut" if truncate else "refused"
    limit = f", max_length {max_length} (longer {longer})" if max_length else ""
    return ConversationSource(
        data, f"conversations of {dataset}: {len(data)} samples, {len(data.skipped)} skipped{limit}"
    )
