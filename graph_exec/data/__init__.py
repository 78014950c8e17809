"""Data for the pipeline: each data-parallel replica's batches, shuffled, collated, resumable.

``DataLoader(source, batch_size, mesh=mesh)`` reads a sequence of samples or a
``mindspore.dataset.GeneratorDataset`` (see ``docs/api.md``, "graph_exec.data").
:class:`ConversationDataset` makes such a sequence of conversations with images, prepared by a
model directory's own processor and chat template (``docs/models.md``, "Fine-tuning on your
conversations"), and :func:`conversation_collate` batches it.
"""

from graph_exec.data.chat import ChatProcessor
from graph_exec.data.chat_dataset import ConversationDataset
from graph_exec.data.collate import (
    collate_batch,
    conversation_collate,
    packing_collate,
    pad_text_samples,
    stack_samples,
)
from graph_exec.data.conversations import Conversation, ConversationError, read_conversations
from graph_exec.data.errors import DataError, SampleError
from graph_exec.data.loader import DataLoader
from graph_exec.data.packing import Packing, SampleCost, pack, row_buckets_upto, spread

__all__ = [
    "ChatProcessor",
    "Conversation",
    "ConversationDataset",
    "ConversationError",
    "DataError",
    "DataLoader",
    "Packing",
    "SampleCost",
    "SampleError",
    "collate_batch",
    "conversation_collate",
    "pack",
    "packing_collate",
    "pad_text_samples",
    "read_conversations",
    "row_buckets_upto",
    "spread",
    "stack_samples",
]
