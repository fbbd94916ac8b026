"""Sampling parameters (validated from the request) and the sampler both workers use.

The prefill worker samples the first token with a generator seeded by ``seed``; the decode worker samples
the rest with a generator seeded by ``seed + 1``, so the same seed gives the same tokens whichever batch a
sequence shares. Without a seed, a random one is drawn at the gateway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from vlkv.common.config import Limits
from vlkv.common.errors import InvalidInput
from vlkv.v1 import generate_pb2

MAX_STOP_CHARS = 256


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

    def to_proto(self) -> generate_pb2.SamplingParams:
        return generate_pb2.SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
        )


def sampling_from_proto(
    pb: generate_pb2.SamplingParams, limits: Limits, *, default_seed: int = 0
) -> SamplingConfig:
    """Validate request sampling parameters; out-of-range values raise InvalidInput."""
    cfg = SamplingConfig(
        max_new_tokens=pb.max_new_tokens if pb.HasField("max_new_tokens") else limits.default_max_new_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else 0.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k if pb.HasField("top_k") else 0,
        seed=pb.seed if pb.HasField("seed") else default_seed,
        stop=list(pb.stop),
    )
    if not 1 <= cfg.max_new_tokens <= limits.max_new_tokens:
        raise InvalidInput(
            f"max_new_tokens must be in [1, {limits.max_new_tokens}], got {cfg.max_new_tokens}"
        )
    if not (math.isfinite(cfg.temperature) and 0.0 <= cfg.temperature <= 100.0):
        raise InvalidInput(f"temperature must be in [0, 100], got {cfg.temperature}")
    if not (math.isfinite(cfg.top_p) and 0.0 < cfg.top_p <= 1.0):
        raise InvalidInput(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k > 1_000_000:
        raise InvalidInput(f"top_k must be <= 1000000, got {cfg.top_k}")
    if len(cfg.stop) > limits.max_stop_strings:
        raise InvalidInput(f"at most {limits.max_stop_strings} stop strings are allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in cfg.stop):
        raise InvalidInput(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
    return cfg


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
