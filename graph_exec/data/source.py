"""Where samples come from: a plain sequence, or a ``mindspore.dataset.GeneratorDataset``.

Both are read by index, so the loader (not the dataset) decides the order and the shard. A
``GeneratorDataset`` is read by MindSpore's own engine (its worker settings kept), with the
loader's indices as its sampler; a sequence is indexed in this process.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from graph_exec.data.errors import DataError, SampleError

_FAILED = re.compile(r"graph_exec: sample (\d+) cannot be read")

#: The column :class:`_Indexed` appends to every row: the sample's index, checked on arrival.
_INDEX_COLUMN = "graph_exec_sample_index"


class SequenceSource:
    """Any object with ``len()`` and integer indexing (a list, a numpy array, a map-style dataset)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def read(self, indices: Sequence[int]) -> Iterator[Any]:
        """The samples at ``indices``, in that order."""
        for index in indices:
            try:
                sample = self.data[int(index)]
            except Exception as exc:  # whatever the source raises, re-raised naming the sample
                raise SampleError(
                    int(index), f"sample {index} cannot be read: {type(exc).__name__}: {exc}"
                ) from exc
            yield sample


class _Indexed:
    """The user's source, its failures naming the index (they cross MindSpore's engine as text),
    each row tagged with its index so that a row the engine skips or reorders is caught."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        try:
            row = self.source[index]
        except Exception as exc:  # as above
            raise RuntimeError(
                f"graph_exec: sample {index} cannot be read: {type(exc).__name__}: {exc}"
            ) from exc
        return (*(row if isinstance(row, tuple) else (row,)), np.array(index, np.int64))


class GeneratorSource:
    """A ``GeneratorDataset`` over a random-accessible source; samples come as ``{column: array}``."""

    def __init__(self, dataset: Any) -> None:
        source = dataset.source
        if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
            raise DataError(
                f"the GeneratorDataset's source ({type(source).__name__}) is not random-accessible: the loader "
                "reads samples by index (for its shuffle, shard and resume position); give it __getitem__ and __len__"
            )
        if dataset.num_shards not in (None, 1):
            raise DataError(
                f"the GeneratorDataset is sharded (num_shards={dataset.num_shards}): the loader shards by "
                "data-parallel rank itself; build the dataset without num_shards/shard_id"
            )
        self.source = source
        self.columns = list(dataset.column_names)
        self.workers = dataset.num_parallel_workers or 1
        self.multiprocessing = bool(dataset.python_multiprocessing) and self.workers > 1

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: Sequence[int]) -> Iterator[dict[str, Any]]:
        """The samples at ``indices``, in that order, read by MindSpore's dataset engine."""
        indices = [int(i) for i in indices]
        if not indices:
            return
        import mindspore.dataset as ds

        pipeline = ds.GeneratorDataset(
            _Indexed(self.source),
            column_names=[*self.columns, _INDEX_COLUMN],
            sampler=indices,
            num_parallel_workers=self.workers,
            python_multiprocessing=self.multiprocessing,
        )
        done = 0
        try:
            for row in pipeline.create_tuple_iterator(num_epochs=1, output_numpy=True):
                _check_arrival(indices, done, int(row[-1]))
                done += 1
                yield dict(zip(self.columns, row[:-1], strict=True))
            if done < len(indices):  # the engine ended early
                _check_arrival(indices, done, -1)
        except RuntimeError as exc:
            found = _FAILED.search(str(exc))
            index = int(found.group(1)) if found else indices[min(done, len(indices) - 1)]
            line = next(
                (ln for ln in str(exc).splitlines() if "graph_exec: sample" in ln), str(exc).splitlines()[0]
            )
            raise SampleError(index, f"sample {index} cannot be read ({line.strip()})") from exc


def _check_arrival(indices: Sequence[int], done: int, arrived: int) -> None:
    """Row ``done`` of a read must be sample ``indices[done]``: the engine may not skip one."""
    if done >= len(indices):
        raise SampleError(
            arrived, f"the dataset engine delivered sample {arrived} beyond the {done} asked for"
        )
    if arrived != indices[done]:
        got = "nothing" if arrived < 0 else f"sample {arrived}"
        raise SampleError(
            indices[done],
            f"sample {indices[done]} was not delivered by the dataset engine (row {done} of the read is {got}): "
            "the loader refuses to let a sample drop out of an epoch",
        )


def as_source(data: Any) -> SequenceSource | GeneratorSource:
    """``data`` as something the loader can read by index."""
    engine = sys.modules.get("mindspore.dataset")  # a dataset object means it is imported already
    if engine is not None and isinstance(data, engine.GeneratorDataset):
        return GeneratorSource(data)
    if engine is not None and isinstance(data, engine.Dataset):
        raise DataError(
            f"a {type(data).__name__} cannot be read by index: pass the GeneratorDataset itself (over a "
            "random-accessible source) and do per-sample work in its source or per-batch work in collate="
        )
    if isinstance(data, str | bytes) or not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise DataError(
            f"source must be a sequence of samples or a mindspore.dataset.GeneratorDataset, got {type(data).__name__}"
        )
    return SequenceSource(data)
