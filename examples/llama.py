"""MindSpore ONE's Llama, its token embedding (trainable by default) as the MPipe preprocess.

The model is ``mindone.transformers.LlamaForCausalLM`` built from a small random config (no
weights are downloaded) and cut by :func:`graph_exec.models.split_model`; the last stage holds
the final norm and the LM head. Needs ``pip install -e '.[models]'``.

Synthetic task (as ``embed_lm``): each sequence counts upward with a stride of 1, 2 or 3 from a
random start, modulo the vocabulary; the model learns to continue it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from graph_exec.examples.common import Example, ExampleModel, conversation_samples

SEQ = 32


@dataclass(frozen=True)
class Size:
    """A preset: width, decoder layers (at least one per stage), heads, vocabulary."""

    hidden: int
    layers: int
    heads: int
    vocab: int = 128


SIZES = {"tiny": Size(hidden=64, layers=4, heads=4), "small": Size(hidden=128, layers=8, heads=4)}


def config(size: Size, layers: int, tie_word_embeddings: bool = False, family: str = "llama"):
    """A random ``LlamaConfig`` of preset ``size`` (``family="qwen2"``: the same as a ``Qwen2Config``,
    the two share these fields)."""
    from graph_exec.models.quiet import quiet_imports

    with quiet_imports():
        from transformers import LlamaConfig, Qwen2Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=2 * size.hidden,
        num_hidden_layers=layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads // 2,
        max_position_embeddings=4 * SEQ,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="eager",
    )


def make_tokens(step: int, batch_size: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)`` of step ``step``: counting sequences, labels the next tokens."""
    rng = np.random.default_rng(step)
    start = rng.integers(0, vocab, (batch_size, 1))
    stride = rng.integers(1, 4, (batch_size, 1))
    seq = ((start + stride * np.arange(SEQ + 1)[None, :]) % vocab).astype(np.int32)
    return seq[:, :-1], seq[:, 1:]


def model(size: str = "tiny", layers: int | None = None, seed: int = 0, tie_word_embeddings: bool = False):
    """The whole mindone ``LlamaForCausalLM`` of preset ``size`` (random weights from ``seed``)."""
    import mindspore as ms

    import graph_exec.models as gm

    preset = SIZES[size]
    ms.set_seed(seed)
    return gm.mindone().LlamaForCausalLM(config(preset, layers or preset.layers, tie_word_embeddings))


def batch(step: int, batch_size: int, size: str = "tiny", vocab: int | None = None):
    """``(inputs, labels)`` of step ``step`` (see :func:`graph_exec.models.lm_inputs`); ``vocab``:
    the model's vocabulary (default the preset's)."""
    import mindspore as ms

    import graph_exec.models as gm

    ids, labels = make_tokens(step, batch_size, vocab or SIZES[size].vocab)
    return tuple(ms.Tensor(a) for a in gm.lm_inputs(ids)), ms.Tensor(labels)


def build(
    num_stages: int,
    trainable_preprocess: bool = True,
    seed: int = 0,
    size: str = "tiny",
    *,
    layers: Sequence[int] | None = None,
    pretrained: str | None = None,
    rank: int = 0,
    pp: int = 1,
    dataset: str | None = None,
    image_root: str | None = None,
    max_length: int | None = None,
    truncate: bool = False,
    skip_bad_samples: bool = False,
    packing: bool = False,
) -> ExampleModel:
    """Llama of preset ``size`` cut into ``num_stages`` chunks after the embedding preprocess.

    ``pretrained``: a pretrained directory (a Llama or Qwen2) instead of the preset's random
    model; pipeline rank ``rank`` of ``pp`` then reads only its own share
    (:func:`graph_exec.models.load_split`), and the preset gives only the sequence length.

    ``dataset`` (with ``pretrained``): batches of the conversations in ``dataset`` instead,
    prepared by the directory's tokenizer and chat template
    (:func:`~graph_exec.examples.common.conversation_samples`), padded to the batch's longest;
    the step's loss is the mean over the global batch's labelled tokens. With ``packing`` (and
    ``max_length``, the row budget): packed into rows instead
    (:func:`graph_exec.models.text_packed_micro_batches`; the split takes segment ids), the same loss.
    """
    if packing and (dataset is None or max_length is None):
        raise ValueError("packing needs dataset= and max_length= (the tokens of a packed row)")
    import graph_exec.models as gm

    preset = SIZES[size]
    if pretrained is not None:
        from graph_exec.models.pretrained import load_config, model_type_of

        family = model_type_of(load_config(pretrained))
        if family not in ("llama", "qwen2"):
            raise ValueError(
                f"the llama example takes a Llama or Qwen2 directory; {pretrained!r} holds {family}"
            )
        split = gm.load_split(
            pretrained,
            num_stages,
            rank=rank,
            pp=pp,
            layers=layers,
            trainable_preprocess=trainable_preprocess,
            packed=packing,
        )
        width, vocab = split.config.hidden_size, split.config.vocab_size
    else:
        total = max(preset.layers, num_stages) if layers is None else sum(layers)
        split = gm.split_model(
            model(size, total, seed),
            num_stages,
            layers=layers,
            trainable_preprocess=trainable_preprocess,
            packed=packing,
        )
        width, vocab = preset.hidden, preset.vocab

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

    def make_batch(step: int, batch_size: int):
        if conversations is None:
            return batch(step, batch_size, size, vocab)
        import mindspore as ms

        from graph_exec.data import pad_text_samples

        pad = conversations.data.processor.pad_token_id
        (ids, positions), labels = pad_text_samples(conversations.samples(step, batch_size), pad_token_id=pad)
        return (ms.Tensor(ids), ms.Tensor(positions)), ms.Tensor(labels)

    example = ExampleModel.of_split(
        split,
        make_batch,
        f"mindone Llama{f' from {pretrained}' if pretrained else ''}: embedding "
        f"({'trainable' if trainable_preprocess else 'frozen'}) as preprocess, width {width}, layers per stage "
        f"{list(split.layers)}, vocab {vocab}, "
        + (conversations.summary if conversations else f"sequence {SEQ}"),
    )
    if conversations is not None:  # padded to the batch's longest: the step line shows the padding
        example.token_counts = conversations.token_counts
        example.token_loss = True

    def packed_batches(
        step: int, batch_size: int, micro: int, *, replica: int = 0, replicas: int = 1
    ) -> list:
        import mindspore as ms

        def make(made: list[dict], packing) -> list:
            pad = conversations.data.processor.pad_token_id
            batches = gm.text_packed_micro_batches(made, packing, max_length, pad_token_id=pad)
            return [(tuple(ms.Tensor(a) for a in inputs), ms.Tensor(labels)) for inputs, labels in batches]

        return conversations.packed(
            step,
            batch_size,
            micro,
            max_length,
            gm.text_sample_costs,
            make,
            replica=replica,
            replicas=replicas,
        )

    if packing:
        example.micro_batches = packed_batches
        example.shards_micro_batches = True
    return example


EXAMPLE = Example(
    "llama",
    "MindSpore ONE Llama, its token embedding as the preprocess (needs pip install -e '.[models]')",
    build,
    trainable_by_default=True,
)
