"""Attention statistics for the compression tests: random Q/K/V and the dense statistics a policy reads from them,
statistics with given column sums, a lookahead draft's column sums, and a long text-only prompt's random ones."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from vlkv.common.compression import get_policy
from vlkv.common.compression.lookahead import with_draft

L, M, D, TAU = 3, 40, 8, 10


def dense_stats(q: torch.Tensor, k: torch.Tensor, q_start: int, p: float = 0.01) -> SimpleNamespace:
    """Reference statistics from the full matrix. q: [H, m, D], k: [H_kv, m, D]; rows q_start..m-1."""
    heads, m, dim = q.shape
    kk = k.repeat_interleave(heads // k.shape[0], dim=0)
    logits = q[:, q_start:] @ kk.transpose(1, 2) / math.sqrt(dim)
    visible = torch.arange(m)[None, :] <= torch.arange(q_start, m)[:, None]  # [Tq, m]
    logits = logits.masked_fill(~visible, -math.inf)
    probs = logits.softmax(-1)
    zero = (probs < p * probs.amax(-1, keepdim=True)) & visible
    return SimpleNamespace(
        row_max=logits.amax(-1),
        row_sumexp=(logits - logits.amax(-1, keepdim=True)).exp().sum(-1),
        col_sum=probs.sum(1),
        below=zero.sum((1, 2)),
        unmasked=visible.sum().expand(heads),
        probs=probs,
    )


def make_inputs(heads: int, kv_heads: int, seed: int = 0, m: int = M):
    gen = torch.Generator().manual_seed(seed)
    qs = [torch.randn(heads, m, D, generator=gen) * 2 for _ in range(L)]
    ks = [torch.randn(kv_heads, m, D, generator=gen) for _ in range(L)]
    vs = [torch.randn(kv_heads, m, D, generator=gen) for _ in range(L)]
    return qs, ks, vs


def stats_for(policy, qs, ks, m: int = M, tau: int = TAU):
    q0 = policy.query_start(m, tau)
    return [dense_stats(q, k, q0) for q, k in zip(qs, ks, strict=True)]


def column_stats(col_sum: torch.Tensor, tq: int, below=None) -> SimpleNamespace:
    """Statistics of ``tq`` query rows with the given ``[heads, m]`` column sums (and ``below`` counts, else 0)."""
    heads, m = col_sum.shape
    return SimpleNamespace(
        row_max=torch.zeros(heads, tq),
        row_sumexp=torch.ones(heads, tq),
        col_sum=col_sum,
        below=torch.zeros(heads) if below is None else below,
        unmasked=torch.full((heads,), float(tq * m)),
    )


def draft_sums(
    heads: int, m: int, layers: int, seed: int, peaked: tuple[int, ...] = ()
) -> list[torch.Tensor]:
    """Per layer ``[heads, m]`` draft column sums of 4 rows; the layers in ``peaked`` put their mass on 2 keys."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(layers):
        if layer in peaked:
            col = torch.full((heads, m), 1e-4)
            col[:, 3] = col[:, 7] = 2.0
        else:
            col = torch.rand(heads, m, generator=gen) + 0.5  # diffuse: many keys to cover the mass
        out.append(col / col.sum(-1, keepdim=True) * 4)
    return out


def draft_stats(seed: int = 0, layers: int = L, m: int = M, peaked: tuple[int, ...] = ()):
    """vlcache's dense statistics of random inputs with a 4-row draft's column sums (``draft_sums``)."""
    qs, ks, _ = make_inputs(4, 2, seed=seed, m=m)
    policy = get_policy("vlcache")
    base = stats_for(policy, qs, ks, m=m)[:layers]
    return with_draft(base, draft_sums(4, m, len(base), seed, peaked), 4)


TEXT_M, TEXT_LAYERS = 1000, 4  # a text-only prompt of 1,000 tokens, 4 layers


def random_text_stats(q0: int, seed: int) -> list:
    """Per layer, column sums of random attention over rows ``q0 .. TEXT_M-1`` (every token scored differently,
    so two presets that keep different sets show it), with the first 40 positions drawing more."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(TEXT_LAYERS):
        col = torch.rand(9, TEXT_M, generator=g) * 0.05
        col[:, :40] += torch.rand(9, 40, generator=g)
        out.append(column_stats(col, TEXT_M - q0))
    return out
