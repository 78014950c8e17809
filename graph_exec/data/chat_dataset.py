"""A data set of conversations: a sequence of samples for :class:`~graph_exec.data.DataLoader`.

Bad samples are never dropped silently: without ``skip_bad_samples`` the first one raises
(from the loader: a :class:`~graph_exec.data.SampleError` whose message names the file and
line); with it, every sample is prepared once up front, each bad one is logged by file, line and
reason, and :attr:`ConversationDataset.skipped` holds them all (their count is
``len(skipped)``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from graph_exec.data.chat import ChatProcessor
from graph_exec.data.conversations import Conversation, ConversationError, read_conversations
from graph_exec.data.errors import DataError

log = logging.getLogger("graph_exec.data")


class ConversationDataset:
    """The samples of the conversations in ``path`` (JSON or JSON lines, see
    :func:`~graph_exec.data.read_conversations`), each made by the model directory's own
    processor (:class:`~graph_exec.data.ChatProcessor`) when read.

    Args:
        path: the data file.
        model_dir: the pretrained directory (its tokenizer, chat template, image processor and
            ``config.json``), or a :class:`ChatProcessor` already made.
        image_root: the folder image paths are relative to (default: the data file's).
        max_length, truncate: see :class:`ChatProcessor`.
        skip_bad_samples: prepare every sample now and leave out the bad ones (each logged,
            all in :attr:`skipped`); otherwise a bad sample raises when it is read.
    """

    def __init__(
        self,
        path: str | Path,
        model_dir: str | Path | ChatProcessor,
        *,
        image_root: str | Path | None = None,
        max_length: int | None = None,
        truncate: bool = False,
        skip_bad_samples: bool = False,
    ) -> None:
        if isinstance(model_dir, ChatProcessor):
            self.processor = model_dir
        else:
            self.processor = ChatProcessor(model_dir, max_length=max_length, truncate=truncate)
        self.path = Path(path)
        #: The error of each sample left out, in file order (its file, line and reason).
        self.skipped: list[ConversationError] = []
        self.conversations = read_conversations(
            self.path, image_root, self._skip if skip_bad_samples else None
        )
        if skip_bad_samples:
            self.conversations = [c for c in self.conversations if self._good(c)]
            if self.skipped:
                log.warning("skipped %d bad sample(s) of %s", len(self.skipped), self.path)
        if not self.conversations:
            raise DataError(f"{str(self.path)!r} holds no usable conversation ({len(self.skipped)} skipped)")

    def _good(self, conversation: Conversation) -> bool:
        try:
            self.processor(conversation)
        except ConversationError as exc:
            self._skip(exc)
            return False
        return True

    def _skip(self, error: ConversationError) -> None:
        self.skipped.append(error)
        log.warning("skipping sample %s", error)

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.processor(self.conversations[index])
