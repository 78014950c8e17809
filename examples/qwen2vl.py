"""MindSpore ONE's Qwen2-VL, its vision tower (frozen by default) as the MPipe preprocess.

The model is ``mindone.transformers.Qwen2VLForConditionalGeneration`` built from a small random
config (no weights are downloaded) and cut by :func:`graph_exec.models.split_model`: the vision
tower and patch merger are the preprocess, replicated on every rank; stage 0 embeds the tokens
and puts the image embeddings in the image positions; the last stage holds the final norm and
the LM head. Needs ``pip install -e '.[models]'``.

Synthetic task: every image is a noisy pattern of one of ``CLASSES`` kinds; the text after it
counts upward from an offset set by that kind, so the loss falls as the model learns to read
the image. Sequence: ``<vision_start> <image>×N <vision_end> text…``; only the text positions
carry a loss.

Build options beyond the common ones: ``layers`` (decoder layers per stage, e.g. the
rebalanced split of :func:`graph_exec.models.rebalanced_layers`), ``vision_depth`` (vision
blocks; ``graph-exec bench qwen2vl --tower-ratio`` sets it), and ``image_sizes`` /
``images_per_sample`` (``graph-exec run qwen2vl --image-sizes 16x16,32x24 --images-per-sample
0-2``): real samples instead, each with its own number of images of sizes drawn per image (a
generator seeded by the step: the same on every rank), batched by
:func:`graph_exec.models.vlm_batch` for a split that takes any images. A text-only sample counts
from 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graph_exec.examples.common import Example, ExampleModel, GeneratedSource, conversation_samples

CLASSES, TEXT = 4, 16
#: The most images one sample of the mixed batches may hold.
MAX_IMAGES = 8
#: Token ids of the special tokens (the vocabulary's last ids).
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 124, 125, 126, 127


@dataclass(frozen=True)
class Size:
    """A preset: LM width and decoder layers (at least one per stage), vision tower, image."""

    hidden: int
    layers: int
    heads: int
    vision_width: int
    vision_depth: int
    image: int  #: pixels per side
    vocab: int = 128
    patch: int = 4
    merge: int = 2
    temporal: int = 2

    @property
    def grid(self) -> tuple[int, int, int]:
        return (1, self.image // self.patch, self.image // self.patch)

    @property
    def image_tokens(self) -> int:
        return (self.image // self.patch) ** 2 // self.merge**2


SIZES = {
    "tiny": Size(hidden=64, layers=4, heads=4, vision_width=32, vision_depth=1, image=16),
    "small": Size(hidden=128, layers=8, heads=4, vision_width=64, vision_depth=4, image=32),
}


def config(size: Size, layers: int, vision_depth: int):  # -> Qwen2VLConfig
    """A random Qwen2-VL config of ``size`` (eager attention: flash attention is Ascend only)."""
    from graph_exec.models.quiet import quiet_imports

    with quiet_imports():
        from transformers import Qwen2VLConfig

    head_dim = size.hidden // size.heads
    quarter = head_dim // 2 // 4  # M-RoPE sections (t, h, w) over head_dim / 2 frequencies
    text = {
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": 2 * size.hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.heads // 2,
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "mrope", "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter]},
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": size.vision_width,
        "num_heads": 4,
        "mlp_ratio": 2,
        "hidden_size": size.hidden,
        "patch_size": size.patch,
        "temporal_patch_size": size.temporal,
        "spatial_merge_size": size.merge,
        "in_channels": 3,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        attn_implementation="eager",
    )


def check_data_layout(config, preset: Size, where: str) -> None:
    """``ValueError`` unless ``config`` reads this example's batches: the preset's vocabulary,
    special tokens and image patching."""
    vision = config.vision_config
    want = {
        "vocab_size": (config.text_config.vocab_size, preset.vocab),
        "image_token_id": (config.image_token_id, IMAGE_TOKEN),
        "vision_start_token_id": (config.vision_start_token_id, VISION_START),
        "vision_end_token_id": (config.vision_end_token_id, VISION_END),
        "patch_size": (vision.patch_size, preset.patch),
        "temporal_patch_size": (vision.temporal_patch_size, preset.temporal),
        "spatial_merge_size": (vision.spatial_merge_size, preset.merge),
    }
    wrong = [f"{key} {got} (the example needs {need})" for key, (got, need) in want.items() if got != need]
    if wrong:
        raise ValueError(f"{where!r} does not fit the qwen2vl example's batches: {', '.join(wrong)}")


def images(kinds: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``(B, 3, size, size)``: the pattern of each sample's kind plus noise."""
    grid = np.linspace(0, np.pi * 2, size, dtype=np.float32)
    patterns = np.stack(
        [np.sin((k + 1) * grid)[None, :] * np.cos((k + 1) * grid)[:, None] for k in range(CLASSES)]
    )
    noise = 0.3 * rng.standard_normal((len(kinds), 3, size, size))
    return (patterns[kinds][:, None] + noise).astype(np.float32)


def token_ids(kinds: np.ndarray, size: Size) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)``: ``<vs> <image>×N <ve>`` then the counting text, labels aligned
    with the inputs (-100 where nothing is predicted)."""
    from graph_exec.models import IGNORE_INDEX

    text_vocab = IMAGE_TOKEN
    start = kinds[:, None] * (text_vocab // CLASSES) + np.arange(TEXT + 1)[None, :]
    text = (start % text_vocab).astype(np.int32)
    batch, n = len(kinds), size.image_tokens
    head = np.concatenate(
        [
            np.full((batch, 1), VISION_START),
            np.full((batch, n), IMAGE_TOKEN),
            np.full((batch, 1), VISION_END),
        ],
        axis=1,
    ).astype(np.int32)
    ids = np.concatenate([head, text[:, :-1]], axis=1)
    labels = np.full(ids.shape, IGNORE_INDEX, np.int32)
    labels[:, head.shape[1] - 1 :] = text  # <ve> predicts the first text token, and so on
    return ids, labels


def pattern(kind: int, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """``(3, height, width)``: the pattern of ``kind`` at this size plus noise."""
    rows = np.linspace(0, np.pi * 2, height, dtype=np.float32)
    cols = np.linspace(0, np.pi * 2, width, dtype=np.float32)
    image = np.sin((kind + 1) * cols)[None, :] * np.cos((kind + 1) * rows)[:, None]
    return (image[None] + 0.3 * rng.standard_normal((3, height, width))).astype(np.float32)


def mixed_samples(
    step: int,
    batch_size: int,
    image_sizes: Sequence[Sequence[int]],
    images_per_sample: Sequence[int],
    size: str = "tiny",
) -> list[dict]:
    """The samples of step ``step``: each draws its kind, its image count in
    ``images_per_sample`` (LO, HI) and each image's size among ``image_sizes`` ((H, W) pixels);
    ``<vs> <image>×(H·W/(patch·merge)²) <ve>`` per image, then the counting text of its kind
    (from 0 without an image). Labels aligned with the inputs, -100 where nothing is predicted."""
    preset = SIZES[size]
    rng = np.random.default_rng(step)
    low, high = images_per_sample
    samples = []
    for _ in range(batch_size):
        kind = int(rng.integers(0, CLASSES))
        count = int(rng.integers(low, high + 1))
        drawn = [tuple(image_sizes[int(i)]) for i in rng.integers(0, len(image_sizes), count)]
        samples.append(_sample(kind, drawn, preset, rng))
    return samples


def mix_samples(step: int, batch_size: int, mix: str, micro: int, size: str = "tiny") -> list[dict]:
    """The samples of step ``step`` of the bench's image mix ``mix`` (:mod:`graph_exec.report.image_mix`):
    one image each, heavy in the step's heavy micro-batches, light (the preset's image) elsewhere."""
    from graph_exec.report import image_mix

    preset = SIZES[size]
    rng = np.random.default_rng(step)
    sizes = image_mix.image_sizes(mix, micro, batch_size // micro, step, preset.image)
    return [_sample(int(rng.integers(0, CLASSES)), [hw], preset, rng) for hw in sizes]


def image_span(height: int, width: int, preset: Size) -> list[int]:
    """An image's ids as Qwen2-VL's processor writes them: ``<vs> <image>×(h·w/(patch·merge)²) <ve>``."""
    tokens = (height // preset.patch) * (width // preset.patch) // preset.merge**2
    return [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END]


def random_sample(
    sizes: Sequence[tuple[int, int]], text: int, preset: Size, rng: np.random.Generator
) -> dict:
    """A sample in the processor's layout with random content: each image's span (random pixels of
    the ``sizes``), then ``text`` random ids below the special tokens; default labels."""
    ids = [token for height, width in sizes for token in image_span(height, width, preset)]
    images = [rng.standard_normal((3, h, w)).astype(np.float32) for h, w in sizes]
    ids += rng.integers(1, IMAGE_TOKEN, text).tolist()
    return {"input_ids": np.array(ids, np.int32), "images": images}


def _sample(kind: int, drawn: Sequence[tuple[int, int]], preset: Size, rng: np.random.Generator) -> dict:
    """One sample of ``kind`` with images of the ``drawn`` sizes (see :func:`mixed_samples`)."""
    from graph_exec.models import IGNORE_INDEX

    head = [token for height, width in drawn for token in image_span(height, width, preset)]
    offset = kind * (IMAGE_TOKEN // CLASSES) if drawn else 0
    text = ((offset + np.arange(TEXT + 1)) % IMAGE_TOKEN).astype(np.int32)
    ids = np.array(head + text[:-1].tolist(), np.int32)
    labels = np.full(ids.shape, IGNORE_INDEX, np.int32)
    labels[max(len(head) - 1, 0) :] = text if head else text[1:]
    images = [pattern(kind, h, w, rng) for h, w in drawn]
    return {"input_ids": ids, "labels": labels, "images": images}


def model(size: str = "tiny", layers: int | None = None, vision_depth: int | None = None, seed: int = 0):
    """The whole mindone ``Qwen2VLForConditionalGeneration`` of preset ``size`` (random weights
    from ``seed``: the same on every rank), ``layers`` decoder layers (default the preset's)."""
    import mindspore as ms

    import graph_exec.models as gm

    preset = SIZES[size]
    depth = preset.vision_depth if vision_depth is None else vision_depth
    ms.set_seed(seed)
    return gm.mindone().Qwen2VLForConditionalGeneration(config(preset, layers or preset.layers, depth))


def batch(model, step: int, batch_size: int, size: str = "tiny"):
    """``(inputs, labels)`` of step ``step`` for the split ``model`` (see :func:`graph_exec.models.vlm_inputs`)."""
    import mindspore as ms

    import graph_exec.models as gm

    preset = SIZES[size]
    rng = np.random.default_rng(step)
    kinds = rng.integers(0, CLASSES, batch_size)
    ids, labels = token_ids(kinds, preset)
    pixels = gm.image_patches(images(kinds, preset.image, rng), preset.patch, preset.temporal, preset.merge)
    grid = np.tile(np.array(preset.grid, np.int64), (batch_size, 1))
    inputs = gm.vlm_inputs(model, ids, pixels.reshape(-1, pixels.shape[-1]), grid)
    return tuple(ms.Tensor(a) for a in inputs), ms.Tensor(labels)


def build(
    num_stages: int,
    trainable_preprocess: bool = False,
    seed: int = 0,
    size: str = "tiny",
    *,
    layers: Sequence[int] | None = None,
    vision_depth: int | None = None,
    pretrained: str | None = None,
    rank: int = 0,
    pp: int = 1,
    image_sizes: Sequence[Sequence[int]] | None = None,
    images_per_sample: Sequence[int] | None = None,
    image_mix: str | None = None,
    mix_micro: int = 1,
    tower_unit: float = 1.0,
    pad_per_micro: bool = False,
    dataset: str | None = None,
    image_root: str | None = None,
    max_length: int | None = None,
    truncate: bool = False,
    skip_bad_samples: bool = False,
    packing: bool = False,
    pack_balance: str | None = None,
) -> ExampleModel:
    """Qwen2-VL of preset ``size`` cut into ``num_stages`` chunks; the tower frozen unless asked.

    ``pretrained``: a Qwen2-VL pretrained directory instead of the random model, whose images and
    special tokens are the preset's (``make_pretrained --model qwen2vl --size SIZE`` writes one);
    pipeline rank ``rank`` of ``pp`` then reads only its own share
    (:func:`graph_exec.models.load_split`).

    ``image_sizes`` / ``images_per_sample``: batches of real samples (:func:`mixed_samples`,
    :func:`graph_exec.models.vlm_batch`) for a split that takes any images (no ``image_grid``).

    ``image_mix`` (``"uniform"`` / ``"skewed"``, ``graph-exec bench qwen2vl --image-mix``): the
    bench's mix of :func:`mix_samples` over ``mix_micro`` micro-batches, each micro-batch's tower
    cost (:attr:`ExampleModel.tower_costs`) its real patches in light micro-batches times
    ``tower_unit`` (a light micro-batch's tower forward in chunk forwards, calibrated).

    ``pad_per_micro`` (with real samples): the example also gives its batches as micro-batches
    padded each to its own sizes (:attr:`ExampleModel.micro_batches`,
    :func:`graph_exec.models.vlm_micro_batches`), so each micro-batch's tower runs at its own
    patch count instead of the batch's largest.

    ``dataset`` (with ``pretrained``; ``graph-exec run qwen2vl --pretrained DIR --dataset FILE``):
    batches of the conversations in ``dataset`` instead, prepared by the directory's own processor
    and chat template (:func:`~graph_exec.examples.common.conversation_samples`); the directory's
    special tokens are then checked against its tokenizer, not the preset's. The step's loss is
    then the mean over the global batch's labelled tokens; with ``packing`` (and ``max_length``,
    the row budget) the samples are packed into rows (:func:`graph_exec.data.pack`, balanced by
    tower cost; :func:`graph_exec.models.vlm_packed_micro_batches`), the same loss.

    ``pack_balance`` (``"tower"`` / ``"tokens"``, with ``image_mix``; ``graph-exec bench qwen2vl
    --image-mix MIX --packing``): each step's mix samples packed into rows of ``max_length``
    tokens (default: :func:`mix_row_tokens`) with that balance, each micro-batch's tower
    cost its patches against a light micro-batch's of the same sample count.
    """
    import mindspore as ms

    import graph_exec.models as gm

    preset = SIZES[size]
    conversations = None
    if dataset is not None:
        conversations = conversation_samples(
            dataset,
            pretrained,
            image_root=image_root,
            max_length=max_length,
            truncate=truncate,
            skip_bad_samples=skip_bad_samples,
        )
    mixed = image_sizes is not None or images_per_sample is not None or image_mix is not None or bool(dataset)
    grid = None if mixed else preset.grid
    if pretrained is not None:
        split = gm.load_split(
            pretrained,
            num_stages,
            rank=rank,
            pp=pp,
            layers=layers,
            trainable_preprocess=trainable_preprocess,
            image_grid=grid,
        )
        if conversations is None:
            check_data_layout(split.config, preset, pretrained)
        whole, depth = split.model, split.config.vision_config.depth
    else:
        depth = preset.vision_depth if vision_depth is None else vision_depth
        total = max(preset.layers, num_stages) if layers is None else sum(layers)
        whole = model(size, total, depth, seed)
        split = gm.split_model(
            whole,
            num_stages,
            layers=layers,
            trainable_preprocess=trainable_preprocess,
            image_grid=grid,
        )
    sizes = image_sizes or [(preset.image, preset.image)]
    counts = images_per_sample or (1, 1)

    pad = conversations.data.processor.pad_token_id if conversations else 0

    def samples(step: int, batch_size: int) -> list[dict]:
        if conversations is not None:
            return conversations.samples(step, batch_size)
        if image_mix is not None:
            return mix_samples(step, batch_size, image_mix, mix_micro, size)
        return mixed_samples(step, batch_size, sizes, counts, size)

    def tensors(made: gm.VLMBatch) -> tuple[tuple[ms.Tensor, ...], ms.Tensor]:
        return tuple(ms.Tensor(a) for a in made.inputs), ms.Tensor(made.labels)

    def make_batch(step: int, batch_size: int):
        if not mixed:
            return batch(whole, step, batch_size, size)
        return tensors(gm.vlm_batch(whole, samples(step, batch_size), pad_token_id=pad))

    def micro_batches(step: int, batch_size: int, micro: int):
        made = gm.vlm_micro_batches(whole, samples(step, batch_size), micro, pad_token_id=pad)
        return [tensors(batch) for batch in made]

    def packed_tower_costs(inputs: Sequence, micro: int) -> tuple[float, ...]:
        """:func:`tower_costs` of packed rows: their tower work, not their real patches."""
        work = packed_tower_work(inputs[1].asnumpy(), micro)
        light = (preset.image // preset.patch) ** 2 * (inputs[1].shape[0] // micro)
        return tuple(float(w) / light * tower_unit for w in work)

    def packed_batches(step: int, batch_size: int, micro: int, *, replica: int = 0, replicas: int = 1):
        def make(made: list[dict], packing) -> list:
            batches = gm.vlm_packed_micro_batches(whole, made, packing, max_length, pad_token_id=pad)
            return [tensors(b) for b in batches]

        def costs_of(made: list[dict]) -> list:
            return gm.vlm_sample_costs(whole, made)

        return conversations.packed(
            step, batch_size, micro, max_length, costs_of, make, replica=replica, replicas=replicas
        )

    def tower_costs(inputs: Sequence, micro: int) -> tuple[float, ...]:
        """Per micro-batch: its real patches (``VLMBatch.patches`` summed) in light micro-batches,
        times ``tower_unit``; read from the batch itself, so the same on every rank."""
        patches = (np.asarray(inputs[1].asnumpy()) >= 0).sum(axis=1)
        light = (preset.image // preset.patch) ** 2 * (len(patches) // micro)
        per_micro = patches.reshape(micro, -1).sum(axis=1)
        return tuple(float(p) / light * tower_unit for p in per_micro)

    images = (
        conversations.summary
        if conversations is not None
        else f"{image_mix} image mix of {preset.image}px and {image_mix_heavy(preset.image)}px images "
        f"({'each micro-batch' if pad_per_micro else 'the batch'} padded, masked)"
        if image_mix is not None
        else f"{counts[0]}-{counts[1]} images per sample of {', '.join(f'{h}x{w}' for h, w in sizes)} px (padded, masked)"
        if mixed
        else f"{preset.image}px images -> {preset.image_tokens} tokens"
    )

    example = ExampleModel.of_split(
        split,
        make_batch,
        f"mindone Qwen2-VL: vision tower {preset.vision_width} wide x {depth} blocks "
        f"({'trainable' if trainable_preprocess else 'frozen'}), {images}; LM width {preset.hidden}, layers per stage {list(split.layers)}",
    )
    if mixed:
        example.tower_costs = tower_costs
        if pad_per_micro:
            example.micro_batches = micro_batches
    if conversations is not None and not pad_per_micro:  # padded to the batch's longest sample
        example.token_counts = conversations.token_counts
        example.token_loss = True
    if pack_balance is not None:
        _pack_mix(example, whole, preset, image_mix, mix_micro, size, tower_unit, max_length, pack_balance)
    if packing:
        if conversations is None or max_length is None:
            raise ValueError("packing needs dataset= and max_length= (the tokens of a packed row)")
        example.micro_batches = packed_batches
        example.shards_micro_batches = True
        example.tower_spread = conversations.tower_spread
        example.tower_costs = packed_tower_costs
    return example


def packed_tower_work(patch_image: np.ndarray, micro: int) -> np.ndarray:
    """Each of ``micro`` packed micro-batches' tower work, from its ``patch_image`` rows: rows ×
    the fullest row's real patches (``Packing.tower_work``). Every row is padded to the fullest
    one's patches, so this, not the real patches, is what its tower computes."""
    per_row = (np.asarray(patch_image) >= 0).sum(axis=1).reshape(micro, -1)
    return per_row.max(axis=1) * per_row.shape[1]


def mix_row_tokens(size: str = "tiny") -> int:
    """The default packed row of the bench's image mix: a heavy and a light sample's tokens (two
    light samples fit too; with fewer, token-only rows leave micro-batches empty)."""
    preset = SIZES[size]
    heavy, light = image_mix_heavy(preset.image), preset.image
    return sum((side // preset.patch) ** 2 // preset.merge**2 + 2 + TEXT for side in (heavy, light))


def _pack_mix(
    example: ExampleModel,
    whole: Any,
    preset: Size,
    image_mix: str | None,
    mix_micro: int,
    size: str,
    tower_unit: float,
    max_length: int | None,
    balance: str,
) -> None:
    """``build(pack_balance=...)``: the image mix's samples as packed micro-batches."""
    import mindspore as ms

    import graph_exec.models as gm

    if image_mix is None:
        raise ValueError(f"pack_balance={balance!r} packs the bench's image mix: give image_mix=")
    length = max_length or mix_row_tokens(size)
    source = GeneratedSource(lambda step, batch: mix_samples(step, batch, image_mix, mix_micro, size), "")
    light = (preset.image // preset.patch) ** 2
    share = [1]  # samples per micro-batch of the last step: a light micro-batch's patches

    # Patches padded to a doubling of a light image's: few shapes, so few compilations.
    buckets = [light]
    while buckets[-1] < length * preset.merge**2:
        buckets.append(2 * buckets[-1])

    def make(made: list[dict], packing: Any) -> list:
        batches = gm.vlm_packed_micro_batches(whole, made, packing, length, patch_pad_to=buckets)
        return [(tuple(ms.Tensor(a) for a in b.inputs), ms.Tensor(b.labels)) for b in batches]

    def packed_batches(step: int, batch_size: int, micro: int) -> list:
        share[0] = max(batch_size // micro, 1)
        return source.packed(step, batch_size, micro, length, costs_of, make, balance=balance)

    def costs_of(made: list[dict]) -> list:
        return gm.vlm_sample_costs(whole, made)

    def tower_costs(inputs: Sequence, micro: int) -> tuple[float, ...]:
        work = packed_tower_work(inputs[1].asnumpy(), micro)
        return tuple(float(w) / (light * share[0]) * tower_unit for w in work)

    example.micro_batches = packed_batches
    example.tower_costs = tower_costs
    example.token_loss = True  # the per-token mean: a micro-batch may hold no sample
    example.token_counts = source.token_counts
    example.tower_spread = source.tower_spread
    example.summary += f"; packed into rows of {length} tokens, balance {balance!r}"


def image_mix_heavy(image: int) -> int:
    """A heavy image's side in the bench's skewed mix."""
    from graph_exec.report import image_mix

    return image_mix.heavy_side(image)[0]


EXAMPLE = Example(
    "qwen2vl",
    "MindSpore ONE Qwen2-VL, its vision tower as the preprocess (needs pip install -e '.[models]')",
    build,
    trainable_by_default=False,
)
