"""Sampling parameters (validated at each process's edge by ``vlkv.common.request``) and the sampler both
workers use.

The prefill worker samples the first token with a generator seeded by ``seed``; the decode worker samples
the rest with a generator seeded by ``seed + 1``, so the same seed gives the same tokens whichever batch a
sequence shares. Without a seed, a random one is drawn at the gateway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import grpc
import torch
from vlkv.common.errors import InvalidInput, VlkvError


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


class NonFiniteLogits(VlkvError):
    """The logits to sample from hold NaN or +inf: the model's output for this request's data is broken.

    INVALID_ARGUMENT: every sampling setting is numerically safe and caches are checked finite at hand-off,
    so what is left is the request's own inputs driving the model out of range; the same request fails the
    same way again, so it is not reported as retryable (the other sequences of its batch decode on)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed % (2**63))


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """logits: ``[vocab]`` fp32 -> one token id (argmax when greedy).

    Numerically safe for every accepted setting (temperature in [0, 100], top_p in (0, 1], any top_k):
    the logits are shifted so their maximum is 0 before they are divided by the temperature (in float64),
    so a tiny temperature only drives the others towards ``-inf`` (probability 0) and never overflows;
    the most likely token always keeps a positive probability. Raises ``NonFiniteLogits`` when the logits
    hold NaN or +inf (or nothing but -inf): the model's output, not the settings, is broken.
    """
    top = logits.max()
    if not torch.isfinite(top):
        raise NonFiniteLogits("the model produced non-finite logits (NaN or inf)")
    if cfg.greedy:
        return int(torch.argmax(logits))
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0.0):
        raise InvalidInput(f"temperature must be a finite number >= 0, got {cfg.temperature}")
    if not (math.isfinite(cfg.top_p) and 0.0 < cfg.top_p <= 1.0):
        raise InvalidInput(f"top_p must be in (0, 1], got {cfg.top_p}")
    # <= 0 everywhere, 0 at the maximum; dividing cannot overflow upwards (the maximum stays 0).
    logits = ((logits.double() - float(top)) / cfg.temperature).float()
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
    if generator is not None and probs.device != generator.device:  # e.g. CUDA logits, a CPU generator
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))
