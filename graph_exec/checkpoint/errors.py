"""Checkpoint errors (importable without MindSpore).

Each one names the directory or file, the step and, where one rank is at fault, the rank, so
that a message read in any rank's log says what to fix.
"""

from __future__ import annotations

from graph_exec.errors import GraphExecError


class CheckpointError(GraphExecError, RuntimeError):
    """Saving or loading a checkpoint failed (on this rank or on another one)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The step asked for is already complete in the directory (checkpoints are never overwritten)."""


class CheckpointCorruptError(CheckpointError):
    """A rank file does not match the checksum recorded when the checkpoint completed."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by a job set up differently (world size, stages, options...)."""


class ReshardWarning(UserWarning):
    """A checkpoint was loaded under another plan than the one that wrote it (says what changed)."""
