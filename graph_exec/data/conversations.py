"""Conversations from JSON or JSON lines, in the two layouts fine-tuning data sets use.

``{"messages": [{"role": "user", "content": "<image>What is this?"}, ...], "images": [...]}``
(OpenAI / LLaMA-Factory "sharegpt-openai") and ``{"conversations": [{"from": "human", "value":
"<image>\\n..."}, ...], "image": "..."}`` (LLaVA / ShareGPT) are read into one
:class:`Conversation`: its messages with roles ``system``/``user``/``assistant``, its image paths
resolved against ``image_root`` (default: the data file's folder), and where it came from (file
and line), so that every later error can name the line to fix. Nothing here opens an image or
loads a tokenizer: :mod:`graph_exec.data.chat` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graph_exec.data.errors import DataError

#: The placeholder of one image in a message's text.
IMAGE_TAG = "<image>"
#: Each layout's role names mapped to the chat template's.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}


class ConversationError(DataError):
    """A conversation that cannot become a sample: ``file``, ``line`` and what is wrong."""

    def __init__(self, file: Path | str, line: int, what: str) -> None:
        super().__init__(f"{file}:{line}: {what}")
        self.file, self.line, self.what = str(file), line, what


@dataclass(frozen=True)
class Conversation:
    """One sample as read: ``messages`` (``{"role", "content"}``, content with ``<image>`` tags),
    ``images`` (paths, one per tag, in order), and its ``file`` and ``line``."""

    messages: tuple[dict[str, str], ...]
    images: tuple[Path, ...]
    file: Path
    line: int

    def error(self, what: str) -> ConversationError:
        """The error naming this conversation's file and line."""
        return ConversationError(self.file, self.line, what)


def read_conversations(
    path: str | Path,
    image_root: str | Path | None = None,
    on_error: Callable[[ConversationError], None] | None = None,
) -> list[Conversation]:
    """Every conversation of ``path`` (a JSON array of records, or JSON lines: one record a
    line), in order. Raises :class:`ConversationError` (file, line, what) for a record that is
    not valid JSON, has neither layout, names an unknown role, has no assistant turn, or whose
    ``<image>`` tags do not match its images in number; ``on_error(error)`` instead leaves the
    record out (a file that is not valid JSON still raises). Image files are checked when opened."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read the data file {str(path)!r}: {exc}") from exc
    root = path.resolve().parent if image_root is None else Path(image_root)
    conversations = []
    for line, record in _records(text, path):
        try:
            conversations.append(parse_record(record, path, line, root))
        except ConversationError as exc:
            if on_error is None:
                raise
            on_error(exc)
    return conversations


def _records(text: str, path: Path) -> list[tuple[int, Any]]:
    """``(line, record)`` of a JSON array or of JSON lines."""
    if text.lstrip().startswith("["):
        return _array_records(text, path)
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConversationError(
                    path, number, f"not valid JSON: {exc.msg} (column {exc.colno})"
                ) from exc
    return records


def _array_records(text: str, path: Path) -> list[tuple[int, Any]]:
    """The elements of a JSON array, each with the line it starts on."""
    decoder, records = json.JSONDecoder(), []
    at = text.index("[") + 1
    while True:
        at = _skip_space(text, at)
        if at < len(text) and text[at] == "]" and not records:
            return records
        try:
            record, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            raise ConversationError(
                path, exc.lineno, f"not valid JSON: {exc.msg} (column {exc.colno})"
            ) from exc
        records.append((text.count("\n", 0, at) + 1, record))
        at = _skip_space(text, end)
        if at < len(text) and text[at] == "]":
            return records
        if at >= len(text) or text[at] != ",":
            line = text.count("\n", 0, at) + 1
            raise ConversationError(path, line, "not valid JSON: expected ',' or ']' after an array element")
        at += 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def parse_record(record: Any, file: Path, line: int, image_root: Path) -> Conversation:
    """One record of either layout as a :class:`Conversation` (see :func:`read_conversations`)."""

    def fail(what: str) -> ConversationError:
        return ConversationError(file, line, what)

    if not isinstance(record, dict):
        raise fail(f"a record is a JSON object, got {type(record).__name__}")
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise fail(
            f"a record has 'messages' (role/content) or 'conversations' (from/value), got keys {sorted(record)}"
        )
    if not isinstance(turns, list) or not turns:
        raise fail("the conversation is empty: it needs a list of turns")
    messages = tuple(_message(turn, k, role_key, text_key, fail) for k, turn in enumerate(turns))
    if not any(m["role"] == "assistant" for m in messages):
        raise fail("the conversation has no assistant turn: nothing to learn from")
    images = _image_paths(record, fail)
    tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    if tags != len(images):
        raise fail(
            f"{tags} {IMAGE_TAG} tag(s) in the text but {len(images)} image(s): each image needs one tag, "
            "in the order of the images"
        )
    return Conversation(messages, tuple(image_root / p for p in images), file, line)


def _message(turn: Any, k: int, role_key: str, text_key: str, fail: Any) -> dict[str, str]:
    if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
        raise fail(f"turn {k} must be an object with {role_key!r} and {text_key!r}, got {turn!r:.80}")
    role, content = turn[role_key], turn[text_key]
    if role not in ROLES:
        raise fail(f"turn {k} has {role_key} {role!r}; allowed: {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise fail(f"turn {k}'s {text_key} must be a string, got {type(content).__name__}")
    return {"role": ROLES[role], "content": content}


def _image_paths(record: dict, fail: Any) -> list[str]:
    images = record.get("images", record.get("image", []))
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise fail(f"'images'/'image' must be a path or a list of paths, got {images!r:.80}")
    return images
