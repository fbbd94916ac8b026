"""Shared fixtures: random-initialised tiny LLaVA checkpoints saved in Hugging Face format."""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from vlkv.tools.task.tiny_llava import build_tiny

WORDS = "what colour shape is the square circle triangle red blue green it a there are one two".split()
TINY_VARIANTS = {
    "llava-gqa": dict(kind="llava", num_heads=4, num_kv_heads=2),
    "llava-mha": dict(kind="llava", num_heads=4, num_kv_heads=4),
    "llava_next-gqa": dict(kind="llava_next", num_heads=4, num_kv_heads=2),
    "llava_next-mha": dict(kind="llava_next", num_heads=4, num_kv_heads=4),
}


def save_tiny_model(path, kind: str, num_heads: int, num_kv_heads: int, seed: int = 0) -> str:
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
    torch.manual_seed(seed)
    cls = LlavaForConditionalGeneration if kind == "llava" else LlavaNextForConditionalGeneration
    model = cls(cfg).eval()
    with torch.no_grad():  # larger logits so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """name -> directory of a saved random tiny model; built lazily, once per session."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = save_tiny_model(tmp_path_factory.mktemp(name), **TINY_VARIANTS[name])
        return built[name]

    return get
