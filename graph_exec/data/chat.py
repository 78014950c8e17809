"""A conversation made into a training sample by the model directory's own processor.

:class:`ChatProcessor` loads what the model's authors prepare inputs with — the tokenizer, its
chat template and (Qwen2-VL) the image processor with its pixel limits — from the pretrained
directory, and turns a :class:`~graph_exec.data.conversations.Conversation` into the sample
:func:`graph_exec.models.vlm_batch` takes: ``input_ids``, ``labels`` and ``images`` (each image's
own ``pixel_values`` rows and ``grid_thw``, the processor's concatenated ``pixel_values`` cut per
image).

Labels. Only the assistant's tokens are learnt: each assistant turn as the template renders it
after the generation prompt (its text and the end-of-turn token, e.g. Qwen's ``<|im_end|>``; not
the whitespace the template puts between turns). Everything else — system and user turns, the
template's headers, image tokens — carries ``-100``. The turn's characters are found by
rendering the conversation up to each assistant turn, so any template whose renderings of a
conversation's beginnings are beginnings of its rendering works (a template that rewrites
earlier turns is refused). The labels are this library's: *shifted*, ``labels[i]`` is the
token at ``i + 1`` (Hugging Face's ``labels[i]`` is the token at ``i`` and the model shifts).

``max_length`` cuts a longer sample to its first ``max_length`` tokens (``truncate=True``; a cut
through an image's tokens, or one that leaves no assistant token, is refused) or refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from graph_exec.data.conversations import IMAGE_TAG, Conversation
from graph_exec.data.errors import DataError

IGNORE_INDEX = -100
#: The Qwen2-VL tokens whose ids the tokenizer and the config must agree on.
VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class ChatProcessor:
    """The directory ``model_dir``'s processor (Qwen2-VL) or tokenizer (Llama, Qwen2) with its
    chat template, checked against the directory's ``config.json``.

    Raises :class:`~graph_exec.data.DataError` naming the directory for a Qwen2-VL directory
    without ``preprocessor_config.json``, a directory without tokenizer or chat template, and a
    tokenizer whose special tokens are not at the config's ids (or whose vocabulary is larger
    than the model's).
    """

    def __init__(
        self, model_dir: str | Path, *, max_length: int | None = None, truncate: bool = False
    ) -> None:
        from graph_exec.models.pretrained import load_config, model_type_of

        self.model_dir = Path(model_dir)
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2
        ):
            raise DataError(f"max_length must be an int >= 2 or None, got {max_length!r}")
        self.max_length, self.truncate = max_length, bool(truncate)
        self.config = load_config(self.model_dir)
        self.vision = model_type_of(self.config) == "qwen2_vl"
        self.processor = self._load()
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.chat_template = getattr(self.processor, "chat_template", None) or self.tokenizer.chat_template
        if not self.chat_template:
            raise DataError(
                f"{str(self.model_dir)!r} has no chat template (tokenizer_config.json or chat_template.json)"
            )
        self._check_special_tokens()

    def _load(self) -> Any:
        where = str(self.model_dir)
        if not any((self.model_dir / name).is_file() for name in TOKENIZER_FILES):
            raise DataError(f"{where!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        if self.vision:
            if not (self.model_dir / "preprocessor_config.json").is_file():
                raise DataError(
                    f"{where!r} has no processor: a Qwen2-VL directory needs preprocessor_config.json (the "
                    "image processor's patch size, merge size and pixel limits) beside its tokenizer"
                )
            import graph_exec.models as gm
            from graph_exec.models.quiet import quiet_imports

            with quiet_imports():  # its tokenizer fallback note, not about the user's data
                return gm.mindone().AutoProcessor.from_pretrained(where)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(where)

    def _check_special_tokens(self) -> None:
        """The tokenizer's ids of the tokens the model's config names must be the config's."""
        size = getattr(self.config, "text_config", self.config).vocab_size
        wrong = []
        if self.vision:
            for attr, token in VISION_TOKENS.items():
                got = self.tokenizer.convert_tokens_to_ids(token)
                if got != getattr(self.config, attr):
                    wrong.append(f"{token} is {got}, config.json's {attr} is {getattr(self.config, attr)}")
        else:
            for name in ("bos", "eos"):
                want = getattr(self.config, f"{name}_token_id", None)
                want = set(want) if isinstance(want, list) else {want}
                got = getattr(self.tokenizer, f"{name}_token_id")
                if got is not None and None not in want and got not in want:
                    wrong.append(f"{name}_token {got}, config.json's {name}_token_id {sorted(want)}")
        if len(self.tokenizer) > size:
            wrong.append(f"the tokenizer has {len(self.tokenizer)} tokens, the model's vocab_size is {size}")
        if wrong:
            raise DataError(
                f"the tokenizer of {str(self.model_dir)!r} does not fit its config.json: {'; '.join(wrong)}"
            )

    @property
    def pad_token_id(self) -> int:
        """The id padding is written with: the tokenizer's pad token, else its end of sequence
        (padding carries no loss and is masked out of attention)."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        """The chat template's text of ``messages``."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def __call__(self, conversation: Conversation) -> dict[str, Any]:
        """The sample of ``conversation``: ``{"input_ids", "labels", "images"}`` (see the module
        docstring); :class:`~graph_exec.data.conversations.ConversationError` naming its file and
        line for what cannot be made."""
        messages = self._template_messages(conversation)
        text = self.render(messages)
        spans = self._assistant_spans(messages, text, conversation)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = np.array([any(a <= s and e <= b for a, b in spans) for s, e in encoded["offset_mapping"]])
        ids = np.array(encoded["input_ids"], np.int64)
        images: list[dict[str, np.ndarray]] = []
        if conversation.images:
            ids, mask, images = self._with_images(text, ids, mask, conversation)
        ids, mask = self._fit(ids, mask, images, conversation)
        return {"input_ids": ids.astype(np.int32), "labels": shifted_labels(ids, mask), "images": images}

    def _template_messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        """Messages as the template reads them: with images, each content a list of parts (an
        ``{"type": "image"}`` part per tag), as Qwen2-VL's processor expects."""
        if not self.vision:
            if conversation.images:
                raise conversation.error(
                    f"the conversation has {len(conversation.images)} image(s), but {str(self.model_dir)!r} holds a text-only "
                    f"{self.config.model_type} model"
                )
            return [dict(m) for m in conversation.messages]
        return [{"role": m["role"], "content": _parts(m["content"])} for m in conversation.messages]

    def _assistant_spans(
        self, messages: list[dict], text: str, conversation: Conversation
    ) -> list[tuple[int, int]]:
        """The characters of each assistant turn in ``text``: from the end of the generation
        prompt before it to the end of its own rendering, trailing whitespace excluded."""
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], generation_prompt=True)
            after = self.render(messages[: k + 1])
            if not (text.startswith(before) and text.startswith(after) and len(before) <= len(after)):
                raise conversation.error(
                    f"the chat template of {str(self.model_dir)!r} renders the conversation up to turn {k} as "
                    "something other than the beginning of the whole: the assistant's tokens cannot be found"
                )
            spans.append((len(before), len(after.rstrip())))
        return spans

    def _with_images(
        self, text: str, ids: np.ndarray, mask: np.ndarray, conversation: Conversation
    ) -> tuple[np.ndarray, np.ndarray, list[dict[str, np.ndarray]]]:
        """The processor's ids, patches and grids; the mask widened over each image's tokens."""
        pictures = [_open_image(path, k, conversation) for k, path in enumerate(conversation.images)]
        out = self.processor(text=[text], images=pictures, add_special_tokens=False, return_tensors="np")
        grids = np.asarray(out["image_grid_thw"]).reshape(-1, 3)
        merge = self.processor.image_processor.merge_size
        counts = [int(np.prod(g)) // merge**2 for g in grids]
        image_token = self.config.image_token_id
        widths = np.ones(len(ids), np.int64)
        if int((ids == image_token).sum()) != len(counts):
            raise conversation.error(
                f"the text holds {int((ids == image_token).sum())} image tokens for {len(counts)} image(s): "
                "is the image token written literally in a message?"
            )
        widths[ids == image_token] = counts
        expanded = np.repeat(ids, widths)
        processed = np.asarray(out["input_ids"][0], np.int64)
        if not np.array_equal(expanded, processed):
            raise conversation.error(
                "the processor's token ids differ from the chat template's tokens with images expanded"
            )
        rows = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        pixels = np.asarray(out["pixel_values"], np.float32)
        images = [
            {"pixel_values": pixels[rows[k] : rows[k + 1]], "grid_thw": grids[k].astype(np.int64)}
            for k in range(len(grids))
        ]
        return processed, np.repeat(mask, widths), images

    def _fit(
        self, ids: np.ndarray, mask: np.ndarray, images: list, conversation: Conversation
    ) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` within ``max_length``: cut (``truncate``) or refused."""
        if not mask[1:].any():
            raise conversation.error("no assistant token after the first position: nothing to learn")
        limit = self.max_length
        if limit is None or len(ids) <= limit:
            return ids, mask
        if not self.truncate:
            raise conversation.error(
                f"{len(ids)} tokens, above max_length {limit} (cut longer samples with truncate=True / "
                "--truncate, skip them with skip_bad_samples=True / --skip-bad-samples, or raise max_length)"
            )
        if images:
            end = np.flatnonzero(ids == self.config.vision_end_token_id)
            if len(end) and end[-1] >= limit:
                raise conversation.error(
                    f"cutting its {len(ids)} tokens at max_length {limit} would cut through its images' tokens "
                    f"(the last image ends at token {int(end[-1]) + 1})"
                )
        if not mask[1:limit].any():
            raise conversation.error(f"no assistant token within max_length {limit}: nothing left to learn")
        return ids[:limit], mask[:limit]


def shifted_labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """This library's labels: ``labels[i] = ids[i + 1]`` where token ``i + 1`` is the
    assistant's, ``-100`` elsewhere and at the last position."""
    labels = np.full(len(ids), IGNORE_INDEX, np.int32)
    labels[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    return labels


def _parts(content: str) -> list[dict[str, str]]:
    """``"<image>What?"`` as ``[{"type": "image"}, {"type": "text", "text": "What?"}]``."""
    parts: list[dict[str, str]] = []
    for k, piece in enumerate(content.split(IMAGE_TAG)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _open_image(path: Path, k: int, conversation: Conversation) -> Any:
    """Image ``k`` as an RGB Pillow image, decoded now (so a broken file fails here, named)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError as exc:
        raise conversation.error(f"image {k} {str(path)!r} does not exist") from exc
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise conversation.error(f"image {k} {str(path)!r} cannot be read: {exc}") from exc
