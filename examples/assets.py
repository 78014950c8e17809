"""A model directory's non-weight files, made offline: tokenizer, chat template, image processor.

``write_tokenizer_and_processor(out_dir, config)`` writes what a Hub directory carries beside its
weights, sized for the examples' tiny vocabularies, so that ``graph_exec.data``'s conversation
reader (which loads the directory's own processor) runs without a network:

- ``tokenizer.json``: a small BPE trained here with the ``tokenizers`` package over printable
  ASCII (a 128-id vocabulary cannot hold the 256 bytes of a byte-level BPE; other characters
  become ``<unk>``). The special tokens sit at the config's ids: for Qwen2-VL / Qwen2
  ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` at
  ``image_token_id`` etc., and ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ``<|vision_pad|>`` at the highest free ids; for Llama ``<|begin_of_text|>`` / ``<|eot_id|>``
  at ``bos_token_id`` / ``eos_token_id``.
- ``tokenizer_config.json`` and ``chat_template.json``: the chat template. Qwen's is written
  here in Jinja to render as Qwen2-VL's does (a default system turn, ``<|im_start|>role\\n …
  <|im_end|>\\n``, each image ``<|vision_start|><|image_pad|><|vision_end|>``); Llama's as
  Llama 3's headers.
- ``preprocessor_config.json`` (Qwen2-VL): the image processor with the config's patch, merge
  and temporal sizes and small ``min_pixels``/``max_pixels`` so that tests stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Qwen2-VL's special tokens other than the vision ones the config names.
QWEN_EXTRA = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>")
#: The config attribute holding each of Qwen2-VL's vision tokens' id.
QWEN_VISION = {
    "<|image_pad|>": "image_token_id",
    "<|video_pad|>": "video_token_id",
    "<|vision_start|>": "vision_start_token_id",
    "<|vision_end|>": "vision_end_token_id",
}
LLAMA_EXTRA = ("<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>")

#: Qwen2-VL's chat rendering: a default system turn unless the first message is one; each
#: message ``<|im_start|>{role}\n{content}<|im_end|>\n``, where a list content renders its image
#: parts as the vision block (``Picture k: `` before it with ``add_vision_id``) and its text
#: parts as they are; ``<|im_start|>assistant\n`` as the generation prompt.
QWEN_TEMPLATE = (
    "{% set seen = namespace(images=0, videos=0) %}"
    "{% if messages and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set seen.images = seen.images + 1 %}"
    "{% if add_vision_id %}Picture {{ seen.images }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set seen.videos = seen.videos + 1 %}"
    "{% if add_vision_id %}Video {{ seen.videos }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Llama 3's headers: ``<|begin_of_text|>`` once, then per message
#: ``<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>``.
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: Text the BPE's merges are learnt from: the template's own words and a little English.
CORPUS = (
    "system user assistant You are a helpful assistant.",
    "What is in this picture? The picture shows a red square on a blue ground.",
    "Describe the image. It is a small green circle. What color is it? Which one is larger?",
    "Hello! How are you today? I am fine, thank you. Tell me a short story about a cat.",
    "The first image is wider than the second one. Both images are tiny patterns of colors.",
)
#: Printable ASCII and the newline: the BPE's alphabet.
ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"]
UNK = "<unk>"

#: Qwen2-VL's image normalisation (CLIP's mean and std).
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def _is_qwen(config: Any) -> bool:
    return config.model_type in ("qwen2_vl", "qwen2")


def _vocab_size(config: Any) -> int:
    return int(getattr(config, "text_config", config).vocab_size)


def special_ids(config: Any) -> dict[str, int]:
    """Each special token's id: those the config names at its ids, the others at the highest
    ids left (``<unk>`` of the BPE at the lowest free one)."""
    size = _vocab_size(config)
    if _is_qwen(config):
        fixed = {tok: getattr(config, attr) for tok, attr in QWEN_VISION.items() if hasattr(config, attr)}
        extra = QWEN_EXTRA + tuple(tok for tok in QWEN_VISION if tok not in fixed)
    else:
        fixed = {"<|begin_of_text|>": config.bos_token_id, "<|eot_id|>": _first(config.eos_token_id)}
        extra = LLAMA_EXTRA
    fixed = {tok: int(i) for tok, i in fixed.items()}
    taken = set(fixed.values())
    free_top = (i for i in range(size - 1, -1, -1) if i not in taken)
    ids = dict(fixed)
    for tok in extra:
        ids[tok] = next(free_top)
    ids[UNK] = min(i for i in range(size) if i not in ids.values())
    return ids


def _first(value: Any) -> int:
    return int(value[0]) if isinstance(value, list | tuple) else int(value)


def train_tokenizer(config: Any) -> Any:
    """A ``tokenizers.Tokenizer``: a BPE over :data:`ALPHABET` filling the ids the special
    tokens leave free, merges learnt from :data:`CORPUS`; specials at :func:`special_ids`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = special_ids(config)
    free = [i for i in range(_vocab_size(config)) if i not in specials.values()]
    if len(free) < len(ALPHABET):
        raise ValueError(
            f"vocab_size {_vocab_size(config)} leaves {len(free)} ids for text; the tokenizer needs at least "
            f"{len(ALPHABET)} (printable ASCII and the newline)"
        )
    split = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+"), behavior="isolated")
    learner = Tokenizer(models.BPE(unk_token=UNK))
    learner.pre_tokenizer = split
    trainer = trainers.BpeTrainer(
        vocab_size=len(free), initial_alphabet=ALPHABET, limit_alphabet=len(ALPHABET), show_progress=False
    )
    learner.train_from_iterator(CORPUS, trainer)
    learnt = json.loads(learner.to_str())["model"]
    tokens = sorted(learnt["vocab"], key=learnt["vocab"].get)[: len(free)]
    vocab = {tok: free[k] for k, tok in enumerate(tokens)} | specials
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    merges = [m for m in merges if "".join(m) in vocab]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in specials])
    return tokenizer


def _tokenizer_config(config: Any, template: str) -> dict[str, Any]:
    if _is_qwen(config):
        tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
        cls = "Qwen2Tokenizer"
    else:
        tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
        cls = "PreTrainedTokenizerFast"
    return {
        "tokenizer_class": cls,
        "unk_token": UNK,
        **tokens,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }


def _preprocessor_config(config: Any, min_pixels: int, max_pixels: int) -> dict[str, Any]:
    vision = config.vision_config
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
    }


def write_tokenizer_and_processor(
    out_dir: str | Path, config: Any, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> list[Path]:
    """Write the tokenizer, chat template and (Qwen2-VL) image processor of ``config``'s model
    into ``out_dir``; returns the files written. ``min_pixels``/``max_pixels`` bound the image
    processor's resize (default: one merged patch block and 32 × 32 blocks, i.e. 256 × 256 px
    at the tiny preset's 8 px blocks)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = QWEN_TEMPLATE if _is_qwen(config) else LLAMA_TEMPLATE
    written = [out / "tokenizer.json", out / "tokenizer_config.json", out / "chat_template.json"]
    train_tokenizer(config).save(str(written[0]))
    _write_json(written[1], _tokenizer_config(config, template))
    _write_json(written[2], {"chat_template": template})
    if config.model_type == "qwen2_vl":
        block = config.vision_config.patch_size * config.vision_config.spatial_merge_size
        low = block * block if min_pixels is None else min_pixels
        high = (32 * block) ** 2 if max_pixels is None else max_pixels
        written.append(out / "preprocessor_config.json")
        _write_json(written[-1], _preprocessor_config(config, low, high))
    return written


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
