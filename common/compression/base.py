"""The compression-policy interface: score tokens, keep a recent window plus the top scores, gather.

Lifecycle on the prefill worker, per request:
  1. ``q0 = policy.query_start(m, tau)``: which query rows (``q0 .. m-1``) the statistics kernel must
     cover in every layer (skip the kernel when ``policy.requires_stats`` is False).
  2. ``policy.compress(stats_per_layer, keys_per_layer, values_per_layer, alpha=..., m=..., tau=...,
     first_token=...)`` -> :class:`CompactKV`. It calls ``allocate`` (layer budgets k_l), then per layer
     ``select`` (kept indices per KV head, built from ``score``), then gathers K and V.

The default ``score`` is the post-vision column sum (VL-Cache's); a new policy overrides only what differs
(``score``, ``query_start``). The allocator is a separate, per-request choice by registered name
(``allocators.py``). ``is_full(alpha)`` is the one definition of "keep the whole cache".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from vlkv.common.handoff.compact_kv import CompactKV

from .allocators import get_allocator
from .stats import (
    AttentionStatsLike,
    group_sum,
    kept_prompt_scores,
    max_pool_positions,
    num_query_rows,
    rows_seeing,
    validate_stats,
)

TAU0_WINDOW = 8  # query rows used when the prompt has no post-vision text (tau = 0)


def post_vision_start(m: int, tau: int) -> int:
    """First post-vision query row: ``m - tau``; with ``tau <= 0`` the last ``min(m, 8)`` rows instead."""
    window = tau if tau > 0 else TAU0_WINDOW
    return m - min(m, window)


def recent_count(k: int, ratio: float = 0.1) -> int:
    """Size of the always-kept recent window, ``ceil(ratio * k)`` (at most k)."""
    return min(k, math.ceil(ratio * k - 1e-6 * max(1.0, ratio * k)))


@dataclass
class Policy:
    """Base policy (kvpress-style). Subclasses set ``name`` and override what differs from the default.

    allocator: layer budget allocator, a name registered in ``allocators.py``.
    exact_budget: for the sparsity allocator, hit ``round(alpha * L * m)`` exactly (see budgets.py).
    recent_ratio: fraction of each layer's budget spent on the most recent tokens.
    post_vision_window: the post-vision tokens (the last ``tau``, when the prompt has vision tokens) are kept
    too, up to ``post_vision_cap`` of the budget, and the recent window is counted before them (``select``).
    post_vision_cap: the largest share of a layer's budget the post-vision window takes (0.5: half).
    post_vision_slope: > 0 makes that share shrink with the layer's budget: at most
    ``post_vision_slope * k / m`` of it (so at 10% with slope 5 the cap is 0.5, at 2% it is 0.1).
    post_vision_by_score: the post-vision window's slots go to the post-vision tokens with the best scores
    (the question's key words wherever they sit) rather than to the last ones.
    sink_tokens: the first tokens of the prompt (BOS and the chat frame before the image) are kept before any
    scored token (StreamingLLM's attention sinks), as far as the budget left after the windows allows.
    row_normalized: score each token by its mean attention over the statistics rows that can see it (the
    column sum divided by ``m - max(j, q0)``), so the post-vision tokens, which causal attention shows to
    fewer rows, compete with the vision tokens on equal terms (ZipCache's normalisation on the policy's rows).
    pool_kernel: max-pool the scores along positions with this odd width before the top-k (SnapKV's
    clustering; 1 = none).
    pyramid_beta, cake_tau1, cake_tau2, adaptive_weight, coverage_mass, min_layer_share: parameters of the
    pyramid, CAKE, mixed and coverage allocators (``allocators.py``).
    """

    name: ClassVar[str] = "base"
    scores_need_stats: ClassVar[bool] = True
    always_full: ClassVar[bool] = False  # True: every layer keeps m whatever alpha (the `full` policy)

    allocator: str = "uniform"
    exact_budget: bool = False
    recent_ratio: float = 0.1
    post_vision_window: bool = False
    post_vision_cap: float = 0.5
    post_vision_slope: float = 0.0
    row_normalized: bool = False
    post_vision_by_score: bool = False
    sink_tokens: int = 0
    pool_kernel: int = 1
    pyramid_beta: float = 20.0
    cake_tau1: float = 1.0
    cake_tau2: float = 1.0
    adaptive_weight: float = 0.2
    coverage_mass: float = 0.9
    min_layer_share: float = 0.25

    def __post_init__(self) -> None:
        get_allocator(self.allocator)  # ValueError for an unknown name
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.cake_tau1 <= 0 or self.cake_tau2 <= 0:
            raise ValueError("cake_tau1 and cake_tau2 must be > 0")
        for name in ("post_vision_cap", "adaptive_weight", "min_layer_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.coverage_mass <= 1.0:
            raise ValueError(f"coverage_mass must be in (0, 1], got {self.coverage_mass}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd number, got {self.pool_kernel}")
        if self.post_vision_slope < 0:
            raise ValueError(f"post_vision_slope must be >= 0, got {self.post_vision_slope}")

    def is_full(self, alpha: float) -> bool:
        """Whether budget ``alpha`` keeps the whole cache: ``alpha >= 1`` or the ``full`` policy."""
        return self.always_full or alpha >= 1.0

    @property
    def requires_stats(self) -> bool:
        """Whether ``compress`` reads attention statistics (scorer or allocator) below full budget."""
        return not self.always_full and (self.scores_need_stats or get_allocator(self.allocator).needs_stats)

    def query_start(self, m: int, tau: int) -> int:
        """First absolute query row the statistics must cover (rows ``q0 .. m-1``). Default: post-vision."""
        return post_vision_start(m, tau)

    def allocate(
        self, stats_per_layer: Sequence[AttentionStatsLike | None] | None, alpha: float, m: int, L: int
    ) -> list[int]:
        """Per-layer budgets k_l, ``len == L``, each in ``[1, m]``; ``[m] * L`` when :meth:`is_full`."""
        if self.is_full(alpha):
            return [m] * L
        allocator = get_allocator(self.allocator)
        stats = _require(stats_per_layer, L, self.allocator) if allocator.needs_stats else None
        return allocator.budgets(stats, alpha, m, L, self)

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """Token scores ``[H_kv, m]`` (higher = keep), query-head scores summed within a GQA group.

        keys, values: ``[H_kv, m, D]`` of this layer; stats cover rows ``query_start(m, tau) .. m-1``.
        Default: the column sums over those rows, ``sum_{h in group} sum_{i >= q0} A_hij``
        (stats.col_sum ``[H, m]``); with the default rows, VL-Cache's post-vision score. With
        ``row_normalized`` each column is divided by the number of those rows that see it; with
        ``pool_kernel > 1`` the columns are then max-pooled along positions (SnapKV).
        """
        if stats is None:
            raise ValueError(f"{self.name} scores need attention statistics")
        col_sum = stats.col_sum.float()
        if self.row_normalized:
            col_sum = col_sum / rows_seeing(m, num_query_rows(stats), col_sum.device)
        return group_sum(max_pool_positions(col_sum, self.pool_kernel), keys.shape[0])

    def select(self, scores: torch.Tensor, k: int, tau: int = 0) -> torch.Tensor:
        """Kept positions ``[H_kv, k]`` (int64, ascending, unique) from scores ``[H_kv, m]``.

        The last ``recent_count(k)`` positions are always kept. With ``post_vision_window`` and
        ``0 < tau < m`` the last ``min(tau, post_vision_share(k, m))`` (the post-vision text, the score's
        own window; half the budget by default) are kept as well and the recent window is the
        ``recent_count(k)`` positions before them (the end of the last image). With
        ``post_vision_by_score`` and a question longer than its share, the window's slots go to the
        best-scoring post-vision tokens instead of the last ones. The rest are the top scores among the
        earlier positions, chosen per KV head.
        """
        kv_heads, m = scores.shape
        if not 1 <= k <= m:
            raise ValueError(f"budget {k} outside [1, m={m}]")
        scores = scores.float().nan_to_num(nan=-math.inf)
        if self.sink_tokens:  # attention sinks (StreamingLLM): the first tokens win every top-k below
            scores = scores.clone()
            scores[:, : self.sink_tokens] = math.inf
        recent = recent_count(k, self.recent_ratio)
        window = min(tau, self.post_vision_share(k, m)) if self.post_vision_window and 0 < tau < m else 0
        if self.post_vision_by_score and 0 < window < tau:
            # the post-vision tokens compete among themselves for the window's slots, by their own scores;
            # the recent window is the end of the last image, right before them
            recent = min(recent, k - window, m - tau)
            own = scores[:, m - tau :].topk(window, dim=-1).indices + (m - tau)
            tail = torch.arange(m - tau - recent, m - tau, device=scores.device).expand(kv_heads, recent)
            top = scores[:, : m - tau - recent].topk(k - window - recent, dim=-1).indices
            return torch.cat([top, tail, own], dim=-1).sort(dim=-1).values
        recent = min(k, window + recent)
        tail = torch.arange(m - recent, m, device=scores.device).expand(kv_heads, recent)
        top = scores[:, : m - recent].topk(k - recent, dim=-1).indices
        return torch.cat([top, tail], dim=-1).sort(dim=-1).values

    def post_vision_share(self, k: int, m: int) -> int:
        """How many of a layer's ``k`` slots the post-vision window may take outright:
        ``floor(cap * k)`` with ``cap = post_vision_cap``, or ``min(cap, post_vision_slope * k / m)``."""
        cap = self.post_vision_cap
        if self.post_vision_slope > 0:
            cap = min(cap, self.post_vision_slope * k / m)
        return int(cap * k + 1e-9)

    def plan(
        self,
        stats_per_layer: Sequence[AttentionStatsLike | None] | None,
        keys_per_layer: Sequence[torch.Tensor],
        values_per_layer: Sequence[torch.Tensor],
        *,
        alpha: float,
        m: int,
        tau: int,
    ) -> list[torch.Tensor]:
        """Kept indices per layer, ``[H_kv, k_l]`` each; a full layer (k_l == m) gets ``arange(m)``.

        Statistics are not read (may be None) when :meth:`is_full` holds for ``alpha``.
        """
        num_layers = len(keys_per_layer)
        if len(values_per_layer) != num_layers:
            raise ValueError("keys and values must have one tensor per layer")
        q0 = self.query_start(m, tau)
        needs_stats = self.requires_stats and not self.is_full(alpha)
        stats = _require(stats_per_layer, num_layers, self.name) if needs_stats else None
        for i, keys in enumerate(keys_per_layer):
            if keys.dim() != 3 or keys.shape[1] != m:
                raise ValueError(f"layer {i}: keys {tuple(keys.shape)} are not [H_kv, m={m}, D]")
            if stats is not None:
                validate_stats(stats[i], m, q0, i)
        budgets = self.allocate(stats, alpha, m, num_layers)
        kept = []
        for i, (k_l, keys, values) in enumerate(zip(budgets, keys_per_layer, values_per_layer, strict=True)):
            if k_l >= m:
                kept.append(torch.arange(m, device=keys.device).repeat(keys.shape[0], 1))
                continue
            layer_stats = None if stats is None else stats[i]
            scores = self.score(i, layer_stats, keys, values, m, tau)
            if scores.shape != (keys.shape[0], m):
                raise ValueError(f"{self.name}: scores {tuple(scores.shape)} are not [H_kv, m]")
            kept.append(self.select(scores.to(keys.device), k_l, tau))
        return kept

    def compress(
        self,
        stats_per_layer: Sequence[AttentionStatsLike | None] | None,
        keys_per_layer: Sequence[torch.Tensor],
        values_per_layer: Sequence[torch.Tensor],
        *,
        alpha: float,
        m: int,
        tau: int,
        first_token: int = 0,
    ) -> CompactKV:
        """Compress one sequence's cache. keys/values per layer: ``[H_kv, m, D]`` (post-RoPE).

        With attention statistics, ``prompt_scores`` holds each kept position's attention per covered query
        row (``stats.kept_prompt_scores``). Layers whose budget is m are passed through untouched (the same
        tensors, made contiguous if they are not), so ``alpha >= 1`` and the ``full`` policy return the cache
        bitwise unchanged.
        """
        kept = self.plan(stats_per_layer, keys_per_layer, values_per_layer, alpha=alpha, m=m, tau=tau)
        scores = None
        if self.requires_stats and not self.is_full(alpha):  # plan checked the statistics
            rows = m - self.query_start(m, tau)
            scores = [kept_prompt_scores(s, idx, rows) for s, idx in zip(stats_per_layer, kept, strict=True)]
        out_k, out_v = [], []
        for idx, keys, values in zip(kept, keys_per_layer, values_per_layer, strict=True):
            if idx.shape[1] == m:
                out_k.append(keys if keys.is_contiguous() else keys.contiguous())
                out_v.append(values if values.is_contiguous() else values.contiguous())
                continue
            gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
            out_k.append(keys.gather(1, gather))
            out_v.append(values.gather(1, gather))
        return CompactKV(
            out_k, out_v, prompt_length=m, first_token=first_token, kept_indices=kept, prompt_scores=scores
        )


def _require(
    stats_per_layer: Sequence[AttentionStatsLike | None] | None, num_layers: int, who: str
) -> list[AttentionStatsLike]:
    if (
        stats_per_layer is None
        or len(stats_per_layer) != num_layers
        or any(s is None for s in stats_per_layer)
    ):
        raise ValueError(f"{who} needs attention statistics for each of the {num_layers} layers")
    return list(stats_per_layer)
