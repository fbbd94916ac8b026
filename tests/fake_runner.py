"""A decode runner without a model: its next token depends on every cached K/V value, so a swap-out/swap-in that
lost or moved a value would change the tokens."""

from __future__ import annotations

import torch
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.decode_worker.model_runner import StepInput

VOCAB = 97


class FakeRunner:
    """Writes each step's K/V at slot ``lengths[l]`` and returns a one-hot of a hash of the whole cache."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def step(self, batch: list[StepInput]) -> torch.Tensor:
        logits = torch.zeros(len(batch), VOCAB)
        bs = self.cache.block_size
        for i, s in enumerate(batch):
            total = 0.0
            for table, n in zip(s.tables, s.lengths, strict=True):
                self.cache.k[table[n // bs], :, n % bs] = float(s.token % 7 + 1)
                self.cache.v[table[n // bs], :, n % bs] = float(s.position % 5)
                k, v = self.cache.read(table, n + 1)
                total += float((k * torch.arange(1, n + 2)[:, None]).sum() + v.sum())
            logits[i, int(total + s.position) % VOCAB] = 1.0
        return logits
