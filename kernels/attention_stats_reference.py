"""Pure-torch post-vision attention statistics (the reference, and the CPU production path).

Shapes (H query heads, H_kv KV heads, G = H // H_kv, Tq query rows, m keys, D head dim):

- ``q``: ``[H, Tq, D]``, the query rows at absolute positions ``q_start .. q_start + Tq - 1`` (post-RoPE)
- ``k``: ``[H_kv, m, D]``, all keys (post-RoPE); query head ``h`` reads KV head ``h // G``

With scaled logits ``s_ij = scale * q_i . k_j`` and the causal mask (row ``i`` sees keys
``j <= q_start + i``), the statistics are those of :class:`AttentionStats`. The scores are computed
chunk by chunk (KV heads x query rows) so at most ``chunk_elems`` fp32 scores exist at once, and keys
no row can see (``j >= q_start + Tq``) are never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionStats", "attention_stats_reference", "check_stats_inputs", "unmasked_count"]

# Largest number of fp32 scores held at once by the reference (2 MiB): the chunk's elementwise passes
# (mask, max, threshold count, exp, sums) then run in the CPU's cache; one thread, 9 x 1K query rows
# over 1K keys: 70 ms per layer at 32 MiB, 18 ms at 2 MiB (4K x 4K: 366 -> 203 ms).
DEFAULT_CHUNK_ELEMS = 1 << 19


@dataclass
class AttentionStats:
    """Per-head statistics of ``softmax(s)`` over the causal-visible keys.

    row_max: ``[H, Tq]`` fp32, max over visible keys of ``s_ij``
    row_sumexp: ``[H, Tq]`` fp32, ``sum_j exp(s_ij - row_max_i)`` over visible keys
    col_sum: ``[H, m]`` fp32, ``sum_i A_ij`` with ``A = softmax(s)`` (masked entries count 0)
    below: ``[H]`` int64, visible entries with ``A_ij < p * max_j A_ij`` (``s_ij < row_max_i + ln p``)
    unmasked: ``[H]`` int64, visible entries over the Tq rows; head sparsity is ``below / unmasked``
    """

    row_max: Tensor
    row_sumexp: Tensor
    col_sum: Tensor
    below: Tensor
    unmasked: Tensor

    def sparsity(self) -> Tensor:
        """``[H]`` fp32 share of visible entries the ThresholdFilter zeroes."""
        return self.below.float() / self.unmasked.float()


def unmasked_count(q_start: int, tq: int) -> int:
    """Number of causal-visible entries of ``tq`` rows starting at absolute position ``q_start``."""
    return tq * (q_start + 1) + tq * (tq - 1) // 2


def check_stats_inputs(
    q: Tensor, k: Tensor, q_start: int, threshold: float
) -> tuple[int, int, int, int, int]:
    """Validate shapes and arguments; return ``(H, Tq, D, H_kv, m)``."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q must be [H, Tq, D] and k [H_kv, m, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    n_heads, tq, dim = q.shape
    n_kv, m, dim_k = k.shape
    if dim != dim_k:
        raise ValueError(f"head dim mismatch: q has {dim}, k has {dim_k}")
    if n_kv == 0 or n_heads % n_kv != 0:
        raise ValueError(f"H={n_heads} must be a multiple of H_kv={n_kv}")
    if tq < 1 or q_start < 0 or q_start + tq > m:
        raise ValueError(
            f"need Tq >= 1, q_start >= 0 and q_start + Tq <= m (Tq={tq}, q_start={q_start}, m={m})"
        )
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q and k must share one of fp32/fp16/bf16, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but k on {k.device}")
    if not threshold >= 0.0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    return n_heads, tq, dim, n_kv, m


@torch.no_grad()
def attention_stats_reference(
    q: Tensor,
    k: Tensor,
    *,
    q_start: int,
    scale: float,
    threshold: float = 0.01,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> AttentionStats:
    """Attention statistics of ``q`` ``[H, Tq, D]`` against ``k`` ``[H_kv, m, D]`` in fp32 torch.

    Returns :class:`AttentionStats` on ``q``'s device. Row ``i`` sees keys ``j <= q_start + i``.
    """
    n_heads, tq, dim, n_kv, m = check_stats_inputs(q, k, q_start, threshold)
    group = n_heads // n_kv
    device = q.device
    log_p = math.log(threshold) if threshold > 0 else -math.inf
    n_vis = q_start + tq  # keys j >= n_vis are masked for every row

    qf = (q.float() * scale).view(n_kv, group, tq, dim)
    kf = k[:, :n_vis].float()
    row_max = torch.empty(n_kv, group, tq, dtype=torch.float32, device=device)
    row_sumexp = torch.empty_like(row_max)
    col_sum = torch.zeros(n_kv, group, m, dtype=torch.float32, device=device)
    below = torch.zeros(n_kv, group, dtype=torch.int64, device=device)

    # Chunk sizes: all query rows of as many KV heads as fit, else fewer rows of one KV head.
    per_head_row = group * n_vis
    rows = max(1, min(tq, chunk_elems // per_head_row))
    heads = max(1, min(n_kv, chunk_elems // (per_head_row * rows))) if rows == tq else 1
    # Two reusable fp32 scratch buffers (scores, below-threshold indicator) of the largest chunk.
    scratch = torch.empty(2, heads * group * rows * n_vis, dtype=torch.float32, device=device)
    for t0 in range(0, tq, rows):
        t1 = min(tq, t0 + rows)
        tc, kv_len = t1 - t0, q_start + t1
        # Keys [q_start + t0, kv_len) are the only ones some rows of this chunk cannot see.
        causal = torch.ones(tc, tc, dtype=torch.bool, device=device).triu_(1)
        n_masked = tc * (tc - 1) // 2
        for h0 in range(0, n_kv, heads):
            h1 = min(n_kv, h0 + heads)
            hc = h1 - h0
            shape = (hc, group, tc, kv_len)
            size = math.prod(shape)
            qc = qf[h0:h1, :, t0:t1].reshape(hc, group * tc, dim)
            s = scratch[0, :size].view(hc, group * tc, kv_len)
            torch.bmm(qc, kf[h0:h1, :kv_len].transpose(1, 2), out=s)
            s = s.view(shape)
            s[..., q_start + t0 :].masked_fill_(causal, -math.inf)
            rmax = s.amax(dim=-1)
            s.sub_(rmax.unsqueeze(-1))
            if log_p > -math.inf:
                # fp32 0/1 indicator: summing it is much faster than summing a bool tensor, and exact
                # per row (kv_len < 2**24). Masked entries are -inf and count as below; take them out.
                ind = torch.lt(s, log_p, out=scratch[1, :size].view(shape))
                below[h0:h1] += ind.sum(dim=-1).long().sum(dim=-1) - n_masked
            s.exp_()
            rsum = s.sum(dim=-1)
            col = torch.matmul(rsum.reciprocal().unsqueeze(-2), s)  # [hc, G, 1, kv_len]
            col_sum[h0:h1, :, :kv_len] += col.squeeze(-2)
            row_max[h0:h1, :, t0:t1] = rmax
            row_sumexp[h0:h1, :, t0:t1] = rsum

    unmasked = torch.full((n_heads,), unmasked_count(q_start, tq), dtype=torch.int64, device=device)
    return AttentionStats(
        row_max=row_max.view(n_heads, tq),
        row_sumexp=row_sumexp.view(n_heads, tq),
        col_sum=col_sum.view(n_heads, m),
        below=below.view(n_heads),
        unmasked=unmasked,
    )
