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
    """logits: ``[vocab]`` fp32 -> one token id (``sample_tokens`` for a batch of one; raises its error)."""
    (token,) = sample_tokens(logits[None], [cfg], [generator])
    if isinstance(token, Exception):
        raise token
    return token


def sample_tokens(
    logits: torch.Tensor, configs: list[SamplingConfig], generators: list[torch.Generator | None]
) -> list[int | VlkvError]:
    """logits: ``[S, vocab]`` fp32 -> one token id per row (argmax where greedy), greedy and sampled rows
    in one call; a row that cannot be sampled gets its error instead of a token (the others are unharmed).

    Numerically safe for every accepted setting (temperature in [0, 100], top_p in (0, 1], any top_k):
    each row is shifted so its maximum is 0 before it is divided by its temperature (in float64), so a
    tiny temperature only drives the others towards ``-inf`` (probability 0) and never overflows; the most
    likely token always keeps a positive probability. A row holding NaN or +inf (or nothing but -inf) gets
    ``NonFiniteLogits``: the model's output, not the settings, is broken. top-k keeps the k most likely
    tokens (ties at the k-th broken by index), then top-p the smallest prefix of those reaching ``top_p``.
    Each sampled row draws from its own generator, so a sequence's tokens do not depend on its batch.
    """
    out: list[int | VlkvError | None] = [None] * len(configs)
    top, argmax = logits.max(dim=-1)  # one pass: each row's maximum (finite?) and the greedy token
    finite = torch.isfinite(top).tolist()
    greedy, sampled = argmax.tolist(), []
    for i, cfg in enumerate(configs):
        if not finite[i]:
            out[i] = NonFiniteLogits("the model produced non-finite logits (NaN or inf)")
        elif cfg.greedy:
            out[i] = greedy[i]
        elif not (math.isfinite(cfg.temperature) and cfg.temperature > 0.0):
            out[i] = InvalidInput(f"temperature must be a finite number >= 0, got {cfg.temperature}")
        elif not (math.isfinite(cfg.top_p) and 0.0 < cfg.top_p <= 1.0):
            out[i] = InvalidInput(f"top_p must be in (0, 1], got {cfg.top_p}")
        else:
            sampled.append(i)
    vocab = logits.shape[-1]
    with_k = [i for i in sampled if 0 < configs[i].top_k < vocab]
    without_k = [i for i in sampled if not 0 < configs[i].top_k < vocab]
    for rows, k in ((with_k, max((configs[i].top_k for i in with_k), default=0)), (without_k, 0)):
        if rows:
            for i, token in zip(rows, _sample_rows(logits, top, configs, generators, rows, k), strict=True):
                out[i] = token
    return out  # type: ignore[return-value]


def _sample_rows(logits, top, configs, generators, rows: list[int], k: int) -> list[int]:
    """Temperature, top-k (``k``: the largest of the rows'; 0: none) and top-p for ``rows`` at once, then
    one draw per row from its generator. With top-k only each row's ``k`` best tokens are scored."""
    cfgs = [configs[i] for i in rows]
    device = logits.device
    index = torch.tensor(rows, device=device)
    x, ids = logits[index], None
    if k:  # the candidates: scaling by a positive temperature keeps their order
        x, ids = torch.topk(x, k, dim=-1)  # sorted, most likely first
        ks = torch.tensor([c.top_k for c in cfgs], device=device)[:, None]
        x = x.masked_fill(torch.arange(k, device=device)[None, :] >= ks, float("-inf"))
    temps = torch.tensor([c.temperature for c in cfgs], dtype=torch.float64, device=device)[:, None]
    # <= 0 everywhere, 0 at each row's maximum; dividing cannot overflow upwards (the maximum stays 0).
    probs = torch.softmax(((x.double() - top[index, None].double()) / temps).float(), dim=-1)
    top_p = [c.top_p for c in cfgs]
    if min(top_p) < 1.0:
        if ids is None:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        else:
            sorted_probs, order = probs, None  # already in descending order
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        p = torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
        drop = (cumulative - sorted_probs > p) & (p < 1.0)  # keep the smallest prefix reaching top_p
        kept = sorted_probs.masked_fill(drop, 0.0)
        probs = kept if order is None else torch.zeros_like(probs).scatter_(1, order, kept)
    tokens = []
    for j, i in enumerate(rows):
        row, generator = probs[j], generators[i]
        if generator is not None and row.device != generator.device:  # e.g. CUDA logits, a CPU generator
            row = row.to(generator.device)
        choice = int(torch.multinomial(row, 1, generator=generator))
        tokens.append(choice if ids is None else int(ids[j, choice]))
    return tokens
