"""A random-initialised tiny Llama decoder (GQA: 4 query heads, 2 KV heads) for decoder-only unit tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(num_hidden_layers: int = 4, seed: int = 0, **config) -> LlamaForCausalLM:
    """The model in eval mode, seeded; ``config`` adds or overrides ``LlamaConfig`` fields."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()
