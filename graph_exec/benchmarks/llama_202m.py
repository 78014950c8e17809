"""The Llama the memory benchmarks load (``load_memory``, ``resume_memory``): 202 M parameters at
the default 11 layers, float32, large enough that a rank's share stands out of an idle
MindSpore process's memory. Its own module so that both benchmarks import it and neither the
other."""

from __future__ import annotations


def config(layers: int):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
