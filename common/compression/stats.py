"""What the compression policies read from the attention-statistics kernel, and small reductions over it.

The kernel (``vlkv.kernels.attention_stats``) runs once per layer during prefill over the query rows at
absolute positions ``q_start .. m-1`` (``Tq = m - q_start`` rows) and all ``m`` keys, with the causal mask.
Policies only rely on the attributes listed in :class:`AttentionStatsLike` (duck typing), so tests can
build statistics by hand and the kernel's dataclass needs no import here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class AttentionStatsLike(Protocol):
    """Per-layer attention statistics over query rows ``q_start .. m-1`` (H query heads, Tq rows, m keys).

    row_max: ``[H, Tq]`` fp32, max scaled logit of each row.
    row_sumexp: ``[H, Tq]`` fp32, sum of exp(logit - row_max) of each row.
    col_sum: ``[H, m]`` fp32, sum over the Tq rows of the softmax probabilities (masked entries are 0).
    below: ``[H]`` count of unmasked entries with ``A_ij < p * max_j A_ij`` (ThresholdFilter zeros).
    unmasked: ``[H]`` count of unmasked (causally visible) entries.

    Optional: ``col_sqsum`` ``[H, m]``, the sum over the rows of the squared probabilities; when present
    the CAKE allocator uses it for the exact per-column variance (see ``budgets.cake_preferences``).
    """

    row_max: torch.Tensor
    row_sumexp: torch.Tensor
    col_sum: torch.Tensor
    below: torch.Tensor
    unmasked: torch.Tensor


def num_query_rows(stats: AttentionStatsLike) -> int:
    """Tq, the number of query rows the statistics were computed over."""
    return int(stats.row_max.shape[-1])


def head_sparsity(stats: AttentionStatsLike) -> torch.Tensor:
    """gamma'_h = below_h / unmasked_h, ``[H]`` fp64 (paper eq. 2 on the rows the stats cover)."""
    below = stats.below.to(torch.float64)
    unmasked = stats.unmasked.to(torch.float64).clamp_min(1.0)
    return below / unmasked


def layer_sparsity(stats: AttentionStatsLike) -> float:
    """gamma_l = mean over query heads of gamma'_h (Algorithm 1, line 7)."""
    return float(head_sparsity(stats).mean())


def group_sum(per_query_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Sum query-head rows within each GQA group: ``[H, m] -> [H_kv, m]``.

    Query heads ``i*g .. (i+1)*g - 1`` share KV head ``i`` (g = H // H_kv), the layout of HF ``repeat_kv``.
    """
    heads, length = per_query_head.shape
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return per_query_head.reshape(num_kv_heads, heads // num_kv_heads, length).sum(dim=1)


def max_pool_positions(per_query_head: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``[H, m]`` scores along positions (stride 1, same length; ``kernel`` odd, 1 = unchanged):
    SnapKV's clustering, which keeps the neighbours of a strongly attended token."""
    if kernel <= 1:
        return per_query_head
    pooled = F.max_pool1d(per_query_head.float().unsqueeze(1), kernel, stride=1, padding=kernel // 2)
    return pooled.squeeze(1)


def rows_seeing(m: int, tq: int, device=None) -> torch.Tensor:
    """``[m]`` fp32: how many of the query rows ``m - tq .. m-1`` see key j under the causal mask:
    ``tq`` for ``j < m - tq``, ``m - j`` from there on."""
    j = torch.arange(m, device=device)
    return torch.minimum(torch.full_like(j, tq), m - j).clamp_min(1).float()


def kept_prompt_scores(stats: AttentionStatsLike, kept: torch.Tensor, rows: int) -> torch.Tensor:
    """``[k_l]`` fp16: for each kept position, the attention its tokens got per covered query row, summed over
    every query head (a position holds a different token in each KV head; each adds its group's share).

    kept: ``[H_kv, k_l]`` original positions; rows: how many query rows ``stats`` covered."""
    per_kv_head = group_sum(stats.col_sum.float(), kept.shape[0]).to(kept.device)
    return (per_kv_head.gather(1, kept).sum(dim=0) / max(1, rows)).to(torch.float16)


def validate_stats(stats: AttentionStatsLike, m: int, q_start: int, layer: int) -> None:
    """Fail with a clear message when statistics do not cover the rows a policy asked for."""
    if stats.col_sum.shape[-1] != m:
        raise ValueError(f"layer {layer}: col_sum covers {stats.col_sum.shape[-1]} keys, expected m={m}")
    if num_query_rows(stats) != m - q_start:
        raise ValueError(
            f"layer {layer}: statistics cover {num_query_rows(stats)} query rows, the policy needs "
            f"rows {q_start}..{m - 1} ({m - q_start} rows)"
        )
