"""A tiny random LLaVA and caches prefilled on it for the decode-phase re-compression tests: vlcache at 30%
(sparsity budgets) on one random image each, 70 new tokens asked."""

from __future__ import annotations

from sample_images import random_png
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.sampling import SamplingConfig


def load_tiny(model_dir: str):
    """The model and processor saved in ``model_dir``."""
    cfg = ModelConfig(path=model_dir)
    return load_model(cfg), load_processor(cfg.path)


def prefilled_caches(engine, n: int):
    """The compact caches ``engine`` prefills for ``n`` requests."""
    reqs = [
        engine.prepare(
            [random_png(i)],
            question="what colour is the square ?",
            sampling=SamplingConfig(max_new_tokens=70),
            compression=CompressionSettings(
                "vlcache", 0.3, allocator="sparsity"
            ),  # the budgets these tests were built on
        )
        for i in range(n)
    ]
    return [engine.prefill.run(r).cache for r in reqs]
