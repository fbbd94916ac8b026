"""Random-initialised tiny LLaVA checkpoints saved in Hugging Face format: the variants the tests name, and the
builder (``fixtures.tiny_model_dirs`` builds them lazily, once per session)."""

from __future__ import annotations

import torch
import vlkv.deploy  # noqa: F401 - before transformers: keeps the checkout's root off sys.path
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    MistralConfig,
    Qwen2Config,
)
from vlkv_lab.task.tiny_llava import build_tiny

WORDS = "what colour shape is the square circle triangle red blue green it a there are one two".split()
TINY_VARIANTS = {
    "llava-gqa": dict(kind="llava", num_heads=4, num_kv_heads=2),
    "llava-mha": dict(kind="llava", num_heads=4, num_kv_heads=4),
    "llava_next-gqa": dict(kind="llava_next", num_heads=4, num_kv_heads=2),
    "llava_next-mha": dict(kind="llava_next", num_heads=4, num_kv_heads=4),
}
# The same tiny LLaVA with other decoder families (``common/model/families.py``); the variants above are
# Mistral without a window. Windows of 8 are shorter than the tests' prompts (about 30 tokens).
DECODER_VARIANTS = {
    "llava-llama": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="llama"),
    "llava-qwen2": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="qwen2"),
    "llava_next-qwen2": dict(kind="llava_next", num_heads=4, num_kv_heads=2, decoder="qwen2"),
    "llava-mistral-w64": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="mistral", window=64),
    "llava-mistral-w8": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="mistral", window=8),
    "llava-qwen2-w8": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="qwen2", window=8),
    "llava-gemma3": dict(kind="llava", num_heads=4, num_kv_heads=2, decoder="gemma3_text", window=8),
}


def tiny_decoder(text, decoder: str, window: int = 0):
    """A config of ``decoder``'s transformers class with the tiny Mistral ``text`` config's sizes and ids.
    ``window``: Mistral's ``sliding_window`` on every layer; Qwen2's on every layer after the first; Gemma 3's
    on its sliding layers (the first two of three, the last one global)."""
    sizes = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        max_position_embeddings=text.max_position_embeddings,
        pad_token_id=text.pad_token_id,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        tie_word_embeddings=False,
    )
    if decoder == "llama":
        return LlamaConfig(**sizes)
    if decoder == "mistral":
        return MistralConfig(sliding_window=window or None, **sizes)
    if decoder == "qwen2":
        return Qwen2Config(
            use_sliding_window=bool(window), sliding_window=window or None, max_window_layers=1, **sizes
        )
    if decoder == "gemma3_text":
        types = ["sliding_attention"] * (text.num_hidden_layers - 1) + ["full_attention"]
        return Gemma3TextConfig(
            sliding_window=window, layer_types=types, query_pre_attn_scalar=text.head_dim, **sizes
        )
    raise ValueError(f"unknown decoder {decoder!r}")


def save_tiny_model(
    path, kind: str, num_heads: int, num_kv_heads: int, seed: int = 0, decoder: str = "", window: int = 0
) -> str:
    tok, proc, cfg = build_tiny(
        WORDS,
        kind=kind,
        image_size=32,
        patch_size=8,
        hidden=64,
        layers=3,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vision_hidden=32,
        vision_heads=2,
        max_position_embeddings=1024,
    )
    if decoder:
        cfg.text_config = tiny_decoder(cfg.text_config, decoder, window)
    torch.manual_seed(seed)
    cls = LlavaForConditionalGeneration if kind == "llava" else LlavaNextForConditionalGeneration
    model = cls(cfg).eval()
    with torch.no_grad():  # larger logits so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return str(path)
