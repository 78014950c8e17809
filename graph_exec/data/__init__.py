"""Data for the pipeline: each data-parallel replica's batches, shuffled, collated, resumable.

``DataLoader(source, batch_size, mesh=mesh)`` reads a sequence of samples or a
``mindspore.dataset.GeneratorDataset`` (see ``docs/api.md``, "graph_exec.data").
"""

from graph_exec.data.collate import collate_batch, stack_samples
from graph_exec.data.errors import DataError, SampleError
from graph_exec.data.loader import DataLoader

__all__ = ["DataError", "DataLoader", "SampleError", "collate_batch", "stack_samples"]
