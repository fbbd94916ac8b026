"""What a policy keeps outright, and how raw scores are shaped before the top-k: one place for the
windows, the attention sinks and the pooling every policy shares.

Per layer with budget ``k`` (``Policy.select``), in this order:
- the post-vision window: the last ``min(tau, share)`` prompt tokens (the question), ``share`` from
  :func:`post_vision_share` (or, ``by_score``, the question's best-scoring tokens);
- the recent window: the ``recent_count(k)`` tokens right before it (the paper's 10%);
- the sinks: the first ``sinks`` prompt tokens (StreamingLLM), as far as the budget left allows, earliest
  first;
- the rest: the top scores among the older tokens, per KV head; with ``chunk > 1`` whole chunks of
  ``chunk`` consecutive positions ranked by their summed score (ChunkKV), the best tokens of the last
  chunk that fits only partly.

Scores (``shape_scores``): a column sum over the statistics rows, optionally divided by the number of those
rows that see each key (``row_normalized``, ZipCache's normalisation), then max-pooled along positions
(``pool_kernel``, SnapKV's clustering), then summed over each GQA group, then optionally spread forward
(``span_after``: each token also scores as the best of the ``span_after`` tokens before it, so the tokens
that follow an attended one travel with it: a fact's value after the name the question looks up; the sinks
spread nothing, and the prompt's first ``damp_until`` positions their score times ``damp``).
"""

from __future__ import annotations

import math

import torch

from .stats import group_sum, max_pool_positions, rows_seeing

TAU0_WINDOW = 8  # query rows used when the prompt has no post-vision text (tau = 0)


def post_vision_start(m: int, tau: int) -> int:
    """First post-vision query row: ``m - tau``; with ``tau <= 0`` the last ``min(m, 8)`` rows instead."""
    window = tau if tau > 0 else TAU0_WINDOW
    return m - min(m, window)


def recent_count(k: int, ratio: float = 0.1) -> int:
    """Size of the always-kept recent window, ``ceil(ratio * k)`` (at most k)."""
    return min(k, math.ceil(ratio * k - 1e-6 * max(1.0, ratio * k)))


def post_vision_share(k: int, m: int, cap: float, slope: float) -> int:
    """How many of a layer's ``k`` slots the post-vision window may take outright: ``floor(cap * k)``, or
    with ``slope > 0`` ``floor(min(cap, slope * k / m) * k)``."""
    if slope > 0:
        cap = min(cap, slope * k / m)
    return int(cap * k + 1e-9)


def shape_scores(
    col_sum: torch.Tensor,
    m: int,
    tq: int,
    kv_heads: int,
    *,
    row_normalized: bool,
    pool_kernel: int,
    span_after: int = 0,
    sinks: int = 0,
    damp_until: int = 0,
    damp: float = 0.0,
) -> torch.Tensor:
    """``[H, m]`` column sums over ``tq`` query rows -> ``[H_kv, m]`` scores (see the module docstring).
    The first ``sinks`` positions (kept outright anyway) spread nothing forward; the ones before
    ``damp_until`` (``Policy.span_skip``) spread their score times ``damp``."""
    col_sum = col_sum.float()
    if row_normalized:
        col_sum = col_sum / rows_seeing(m, tq, col_sum.device)
    pooled = group_sum(max_pool_positions(col_sum, pool_kernel), kv_heads)
    return spread_forward(pooled, span_after, sinks, damp_until, damp)


SPAN_DECAY = 1e-4
"""Per position of distance, the relative share a spread score loses (``spread_forward``): only a tie-break,
so the tokens nearest the attended one come first when a span does not fit whole."""


def spread_forward(
    scores: torch.Tensor, span: int, skip: int = 0, damp_until: int = 0, damp: float = 0.0
) -> torch.Tensor:
    """``[H, m]`` -> ``[H, m]``: each position scores the best of itself and the ``span`` positions before it,
    the one ``d`` back weighted ``1 - SPAN_DECAY * d`` (0: unchanged). The first ``skip`` positions (the
    attention sinks, whose score is not about their content) spread nothing; the next ones, up to
    ``damp_until``, spread their score times ``damp`` (0: nothing)."""
    if span <= 0:
        return scores
    source = scores.clone()
    if damp_until > skip:
        source[:, skip:damp_until] = -math.inf if damp <= 0 else source[:, skip:damp_until] * damp
    source[:, :skip] = -math.inf
    out = scores.clone()
    for d in range(1, min(span, scores.shape[-1] - 1) + 1):
        out[:, d:] = torch.maximum(out[:, d:], source[:, :-d] * (1.0 - SPAN_DECAY * d))
    return out


def share_layers(scores: dict[int, torch.Tensor], weight: float, sinks: int = 0) -> dict[int, torch.Tensor]:
    """Per layer ``[H_kv, m]`` scores -> ``max(own, weight * shared)``: every head's scores normalised to sum 1
    (NaN as 0; the first ``sinks`` positions, kept outright, left out as 0), ``shared`` the best normalised
    score each position gets in any layer and head given. A token one layer's window looks up competes in
    every layer."""
    norm = {}
    for layer, s in scores.items():
        s = s.float().nan_to_num(nan=0.0).clamp_min(0.0)
        s[:, :sinks] = 0.0
        norm[layer] = s / s.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    shared = torch.stack([s.amax(dim=0) for s in norm.values()]).amax(dim=0)  # [m]
    return {layer: torch.maximum(s, weight * shared.to(s.device)) for layer, s in norm.items()}


def chunk_keys(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[H, n]`` scores -> ``[H, n]`` keys whose top-k takes whole chunks of ``chunk`` consecutive positions
    (from position 0) in the order of their summed score, each chunk's tokens best first (ChunkKV)."""
    heads, n = scores.shape
    padded = torch.nn.functional.pad(scores, (0, -n % chunk))
    sums = padded.view(heads, -1, chunk).sum(-1)  # [H, chunks]; a -inf token makes its chunk last
    chunk_rank = sums.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1).float()
    token_rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1).float()
    own = chunk_rank.repeat_interleave(chunk, dim=-1)[:, :n]
    return -own + 0.5 * (1.0 - token_rank / n)  # the chunk's rank first, then the token's within it


def _top(scores: torch.Tensor, end: int, count: int, sinks: int, chunk: int = 1) -> torch.Tensor:
    """``count`` positions below ``end`` per head: the first ``sinks`` (earliest first when they do not all
    fit), then the top scores (``chunk > 1``: the best chunks, ``chunk_keys``)."""
    if sinks and count <= min(sinks, end):
        return torch.arange(count, device=scores.device).expand(scores.shape[0], count)
    scores = scores[:, :end].clone()
    if chunk > 1:  # the sinks, kept anyway, do not lift their chunk
        scores[:, :sinks] = 0.0
        scores = chunk_keys(scores, chunk)
    if sinks:  # every sink wins the top-k below
        scores[:, :sinks] = math.inf
    return scores.topk(count, dim=-1).indices


def keep(
    scores: torch.Tensor,
    k: int,
    tau: int,
    *,
    recent_ratio: float,
    window: int,
    by_score: bool,
    sinks: int,
    chunk: int = 1,
) -> torch.Tensor:
    """Kept positions ``[H_kv, k]`` (int64, ascending, unique) from scores ``[H_kv, m]``.

    window: the post-vision window's size (0: none; at most tau, used only when ``0 < tau < m``).
    by_score: with a question longer than ``window``, its slots go to its best-scoring tokens and the
    recent window sits right before the question. chunk: the older tokens are taken in whole chunks
    (``chunk_keys``; 1: token by token). NaN scores rank last.
    """
    kv_heads, m = scores.shape
    if not 1 <= k <= m:
        raise ValueError(f"budget {k} outside [1, m={m}]")
    scores = scores.float().nan_to_num(nan=-math.inf)
    recent = recent_count(k, recent_ratio)
    window = min(tau, window) if 0 < tau < m else 0
    if by_score and 0 < window < tau:
        recent = min(recent, k - window, m - tau)
        own = scores[:, m - tau :].topk(window, dim=-1).indices + (m - tau)
        tail = torch.arange(m - tau - recent, m - tau, device=scores.device).expand(kv_heads, recent)
        top = _top(scores, m - tau - recent, k - window - recent, sinks, chunk)
        return torch.cat([top, tail, own], dim=-1).sort(dim=-1).values
    recent = min(k, window + recent)
    tail = torch.arange(m - recent, m, device=scores.device).expand(kv_heads, recent)
    top = _top(scores, m - recent, k - recent, sinks, chunk)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values
