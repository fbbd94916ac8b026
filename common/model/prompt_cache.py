"""A transformers ``DynamicCache`` holding a prompt's post-RoPE K and V, to decode more tokens over it.

The prefill's forward returns every layer's keys and values ``[H_kv, m, D]`` (one sequence); a few dense
decode steps over the whole prompt (lookahead's draft, the oracle's teacher-forced answer, the first decoding
token's attention in the evaluation) start from this cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


def prompt_cache(model, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` for ``model``'s text decoder with layer ``l`` holding ``keys[l]``/``values[l]``
    (``[H_kv, m, D]``) as a batch of one. Every layer keeps every token, a sliding-window layer's too (the
    model's masks still limit what it reads), so each layer's keys stay ``[H_kv, m + steps, D]``."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k[None], v[None], layer)
    return cache
