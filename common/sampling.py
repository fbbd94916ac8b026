"""Sampling parameters (validated at each process's edge by ``vlkv.common.request``) and the sampler both
workers use.

The prefill worker samples the first token with a generator seeded by ``seed``; the decode worker samples
the rest with a generator seeded by ``seed + 1``, so the same seed gives the same tokens whichever batch a
sequence shares. Without a seed, a random one is drawn at the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed % (2**63))


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits: ``[vocab]`` fp32 -> one token id (argmax when greedy)."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.numel():
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > cfg.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
