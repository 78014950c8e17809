"""Checkpoint and resume a pipelined training job (``ge.save_checkpoint``/``ge.load_checkpoint``).

Layout (``layout``): ``DIR/step_<k>/rank_<r>.ckpt`` per rank in MindSpore's own format, then
``DIR/step_<k>/complete.json`` written last by rank 0; a step without it does not exist.
What a rank owns (``state``), reading only the tensors it holds (``selective``), what the manifest records and compares (``facts``), and the two
collective operations (``api``).
"""

from graph_exec.checkpoint.api import SavedCheckpoint, last_load_bytes, load_checkpoint, save_checkpoint
from graph_exec.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ReshardWarning,
)
from graph_exec.checkpoint.facts import schedule_options
from graph_exec.checkpoint.layout import latest_checkpoint

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ReshardWarning",
    "SavedCheckpoint",
    "last_load_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "schedule_options",
]
