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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vlkv.common.handoff.compact_kv import CompactKV

from .allocators import Allocator, Uniform, allocator_class
from .lookahead import mixed_col_sum
from .selection import (
    TAU0_WINDOW,
    keep,
    post_vision_share,
    post_vision_start,
    recent_count,
    shape_scores,
    share_layers,
)
from .serialize import fields_to_dict
from .stats import AttentionStatsLike, kept_prompt_scores, num_query_rows, validate_stats
from .windows import fit_windows

MAX_LOOKAHEAD = 64  # draft tokens a prefill may decode (each is one decode step over the full cache)

__all__ = ["MAX_LOOKAHEAD", "TAU0_WINDOW", "Policy", "post_vision_start", "recent_count"]


@dataclass
class Policy:
    """Base policy (kvpress-style). Subclasses set ``name`` and override what differs from the default.

    allocator: the layer budget allocator, an :class:`allocators.Allocator` instance holding its own
    parameters (``Pyramid(beta=4.0)``); a registered name is accepted and maps to the default instance.
    What is kept outright and how scores are shaped (``selection.py``, one place for every policy):
    recent_ratio: fraction of each layer's budget spent on the most recent tokens.
    post_vision_window: the post-vision tokens (the last ``tau``, when the prompt has vision tokens) are kept
    too, up to ``post_vision_cap`` of the budget, and the recent window is counted before them.
    post_vision_cap: the largest share of a layer's budget the post-vision window takes (0.5: half).
    post_vision_slope: > 0 makes that share shrink with the layer's budget: at most
    ``post_vision_slope * k / m`` of it (so at 10% with slope 5 the cap is 0.5, at 2% it is 0.1).
    post_vision_by_score: the post-vision window's slots go to the post-vision tokens with the best scores
    (the question's key words wherever they sit) rather than to the last ones.
    sink_tokens: the first tokens of the prompt are kept before any scored token (StreamingLLM's attention
    sinks), as far as the budget left after the windows allows, earliest first.
    row_normalized: score each token by its mean attention over the statistics rows that can see it (the
    column sum divided by ``m - max(j, q0)``; ZipCache's normalisation on the policy's rows).
    pool_kernel: max-pool the scores along positions with this odd width before the top-k (SnapKV's
    clustering; 1 = none).
    text_window: a prompt with no vision tokens (tau = m) is treated as if its last ``text_window`` tokens
    were the post-vision text: they are the statistics rows that score the rest (SnapKV's observation
    window) and, with ``post_vision_window``, kept outright. 0: every row is post-vision (H2O-like scores).
    span_after: each token also scores as the best of the ``span_after`` tokens before it (after pooling
    and the GQA sum), so what follows an attended token is kept with it (0: off).
    span_skip, span_skip_weight: the first ``span_skip`` prompt positions (past the sinks) spread only
    ``span_skip_weight`` times their score forward (0.0: nothing): the chat template's start of the user turn
    and the context's first words draw sink-like attention whatever they say, and spread 12-16 forward they
    take the slots a looked-up fact needs. They still score, and are kept, for their own attention.
    ``span_skip`` 0: off (only the sinks spread nothing).
    layer_share: each layer's scores, normalised to sum 1 per KV head, compete with this weight times the best
    normalised score the token gets in any compressed layer and head (``selection.share_layers``): a token
    the question looks up in some layers is kept in the others too (0: each layer on its own).
    lookahead: draft tokens the prefill worker decodes greedily over the full cache before compressing; their
    attention over the prompt is mixed into the scores (``lookahead.py``; the drafts are discarded, the decode
    worker answers from the compressed cache). 0: off (the scores exactly as without the option).
    lookahead_weight: the draft rows' share of the mixed score, ``(1 - w) * question + w * draft``, each the
    mean attention per row; the allocator reads the question rows only.
    """

    name: ClassVar[str] = "base"
    scores_need_stats: ClassVar[bool] = True
    always_full: ClassVar[bool] = False  # True: every layer keeps m whatever alpha (the `full` policy)

    allocator: Allocator = Uniform()
    recent_ratio: float = 0.1
    post_vision_window: bool = False
    post_vision_cap: float = 0.5
    post_vision_slope: float = 0.0
    post_vision_by_score: bool = False
    sink_tokens: int = 0
    row_normalized: bool = False
    pool_kernel: int = 1
    text_window: int = 0
    span_after: int = 0
    span_skip: int = 0
    span_skip_weight: float = 0.0
    layer_share: float = 0.0
    lookahead: int = 0
    lookahead_weight: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.allocator, str):
            self.allocator = allocator_class(self.allocator)()  # ValueError for an unknown name
        if not isinstance(self.allocator, Allocator):
            raise ValueError(f"allocator must be an Allocator or a registered name, got {self.allocator!r}")
        for name in (
            "recent_ratio",
            "post_vision_cap",
            "layer_share",
            "lookahead_weight",
            "span_skip_weight",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in (
            "sink_tokens",
            "text_window",
            "span_after",
            "span_skip",
            "lookahead",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd number, got {self.pool_kernel}")
        if self.lookahead > MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be at most {MAX_LOOKAHEAD} draft tokens, got {self.lookahead}")
        if self.lookahead and (not self.scores_need_stats or type(self).score is not Policy.score):
            raise ValueError(
                f"lookahead needs the base attention scores; {self.name} scores tokens its own way"
            )
        if self.post_vision_slope < 0:
            raise ValueError(f"post_vision_slope must be >= 0, got {self.post_vision_slope}")

    def to_dict(self) -> dict[str, Any]:
        """``{"policy": name, "allocator": {...}, <option>: value, ..., "text_preset": ""}``, plain JSON (every
        field); ``registry.policy_from_dict`` reads it back. ``text_preset`` "": this policy alone, with no route
        (a dict without the key gets the named policy's default route, as a request naming it does)."""
        return {
            "policy": self.name,
            "allocator": self.allocator.to_dict(),
            **fields_to_dict(self, ("allocator",)),
            "text_preset": "",
        }

    def is_full(self, alpha: float) -> bool:
        """Whether budget ``alpha`` keeps the whole cache: ``alpha >= 1`` or the ``full`` policy."""
        return self.always_full or alpha >= 1.0

    @property
    def requires_stats(self) -> bool:
        """Whether ``compress`` reads attention statistics (scorer or allocator) below full budget."""
        return not self.always_full and (self.scores_need_stats or self.allocator.needs_stats)

    def for_prompt(self, m: int, tau: int, alpha: float | None = None) -> Policy:
        """The policy that compresses a prompt of ``m`` tokens (``tau`` post-vision) at budget ``alpha``: this
        one (a wrapper, ``routing.py``, answers with the policy it hands the prompt to)."""
        return self

    def lookahead_steps(self, alpha: float, m: int, tau: int) -> int:
        """Draft tokens the prefill worker decodes for a prompt of ``m`` tokens (``tau`` post-vision) at budget
        ``alpha``: ``lookahead``, 0 when it keeps the full cache."""
        return 0 if self.is_full(alpha) else self.lookahead

    def observed_tau(self, m: int, tau: int, question: int = 0) -> int:
        """The post-vision length the policy works with: ``tau``; for a prompt with no vision tokens
        (``tau >= m``) ``min(m, text_window)`` when ``text_window`` is set. The one place a text-only prompt's
        observation window is decided. ``question``: the prompt's final question in tokens
        (``common/model/question.py``; 0: unknown), which a subclass may take as its window."""
        if tau < m:
            return tau
        return min(m, self.text_window) if self.text_window else tau

    def rows_options(self) -> tuple[Any, ...]:
        """The options that decide which statistics rows ``observed_tau`` gives a prompt: two policies with the
        same ``query_start`` and equal options read the same rows (``routing.ByBudget`` checks it)."""
        return (self.text_window,)

    def query_start(self, m: int, tau: int, question: int = 0) -> int:
        """First absolute query row the statistics must cover (rows ``q0 .. m-1``). Default: post-vision
        (for a text-only prompt, ``observed_tau``'s window). ``question``: the prompt's final question in
        tokens (``common/model/question.py``; 0: unknown)."""
        return post_vision_start(m, self.observed_tau(m, tau, question))

    def allocate(
        self, stats_per_layer: Sequence[AttentionStatsLike | None] | None, alpha: float, m: int, L: int
    ) -> list[int]:
        """Per-layer budgets k_l, ``len == L``, each in ``[1, m]``; ``[m] * L`` when :meth:`is_full`."""
        if self.is_full(alpha):
            return [m] * L
        stats = _require(stats_per_layer, L, self.allocator.name) if self.allocator.needs_stats else None
        return self.allocator.budgets(stats, alpha, m, L)

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
        ``pool_kernel > 1`` the columns are then max-pooled along positions (SnapKV), and with
        ``span_after`` spread forward (``selection.shape_scores``; not from the sinks, and from the first
        ``span_skip`` positions times ``span_skip_weight``). With ``lookahead`` and statistics that
        carry draft rows (``lookahead.DraftStats``) the column sums are ``lookahead.mixed_col_sum``'s.
        """
        if stats is None:
            raise ValueError(f"{self.name} scores need attention statistics")
        mixed = (
            mixed_col_sum(stats, m, self.lookahead_weight, self.row_normalized) if self.lookahead else None
        )
        return shape_scores(
            stats.col_sum if mixed is None else mixed,
            m,
            num_query_rows(stats),
            keys.shape[0],
            row_normalized=self.row_normalized and mixed is None,
            pool_kernel=self.pool_kernel,
            span_after=self.span_after,
            sinks=self.sink_tokens,
            damp_until=self.span_skip,
            damp=self.span_skip_weight,
        )

    def select(self, scores: torch.Tensor, k: int, tau: int = 0, layer: int = 0) -> torch.Tensor:
        """Kept positions ``[H_kv, k]`` (int64, ascending, unique) from scores ``[H_kv, m]``.

        The last ``recent_count(k)`` positions are always kept. With ``post_vision_window`` and
        ``0 < tau < m`` the last ``min(tau, post_vision_share(k, m))`` (the post-vision text, the score's
        own window; half the budget by default) are kept as well and the recent window is the
        ``recent_count(k)`` positions before them (the end of the last image). With
        ``post_vision_by_score`` and a question longer than its share, the window's slots go to the
        best-scoring post-vision tokens instead of the last ones. ``sink_tokens`` first positions come
        next; the rest are the top scores among the earlier positions, chosen per KV head
        (``selection.keep``). ``layer``: the layer's index (the base policy keeps every layer alike).
        """
        m = scores.shape[-1]
        window = self.post_vision_share(k, m) if self.post_vision_window else 0
        return keep(
            scores,
            k,
            tau,
            recent_ratio=self.recent_ratio,
            window=window,
            by_score=self.post_vision_by_score,
            sinks=self.sink_tokens,
        )

    def post_vision_share(self, k: int, m: int) -> int:
        """How many of a layer's ``k`` slots the post-vision window may take outright
        (``selection.post_vision_share``)."""
        return post_vision_share(k, m, self.post_vision_cap, self.post_vision_slope)

    def plan(
        self,
        stats_per_layer: Sequence[AttentionStatsLike | None] | None,
        keys_per_layer: Sequence[torch.Tensor],
        values_per_layer: Sequence[torch.Tensor],
        *,
        alpha: float,
        m: int,
        tau: int,
        question: int = 0,
        windows: Sequence[int] = (),
    ) -> list[torch.Tensor]:
        """Kept indices per layer, ``[H_kv, k_l]`` each; a full layer (k_l == m) gets ``arange(m)``.

        Statistics are not read (may be None) when :meth:`is_full` holds for ``alpha``. ``question``: as for ``query_start``. ``windows``: per layer its sliding
        window (0: none; ``windows.fit_windows``): a sliding layer keeps at most its reach, its last positions
        without scores, and the rest of its budget goes to the other layers.
        """
        num_layers = len(keys_per_layer)
        if len(values_per_layer) != num_layers:
            raise ValueError("keys and values must have one tensor per layer")
        q0 = self.query_start(m, tau, question)
        tau = self.observed_tau(m, tau, question)  # a text-only prompt's observation window
        needs_stats = self.requires_stats and not self.is_full(alpha)
        stats = _require(stats_per_layer, num_layers, self.name) if needs_stats else None
        for i, keys in enumerate(keys_per_layer):
            if keys.dim() != 3 or keys.shape[1] != m:
                raise ValueError(f"layer {i}: keys {tuple(keys.shape)} are not [H_kv, m={m}, D]")
            if stats is not None:
                validate_stats(stats[i], m, q0, i)
        budgets, tails = fit_windows(self.allocate(stats, alpha, m, num_layers), windows, m)
        scores: dict[int, torch.Tensor] = {}
        for i, (k_l, keys, values) in enumerate(zip(budgets, keys_per_layer, values_per_layer, strict=True)):
            if k_l < m and not tails[i]:
                layer_stats = None if stats is None else stats[i]
                scores[i] = self.score(i, layer_stats, keys, values, m, tau)
                if scores[i].shape != (keys.shape[0], m):
                    raise ValueError(f"{self.name}: scores {tuple(scores[i].shape)} are not [H_kv, m]")
        if self.layer_share > 0 and scores:
            scores = share_layers(scores, self.layer_share, self.sink_tokens)
        kept = []
        for i, (k_l, keys) in enumerate(zip(budgets, keys_per_layer, strict=True)):
            if tails[i] or k_l >= m:  # a sliding layer's last k_l positions (all m: the whole prompt)
                kept.append(torch.arange(m - k_l, m, device=keys.device).repeat(keys.shape[0], 1))
            else:
                kept.append(self.select(scores[i].to(keys.device), k_l, tau, layer=i))
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
        question: int = 0,
        windows: Sequence[int] = (),
    ) -> CompactKV:
        """Compress one sequence's cache. keys/values per layer: ``[H_kv, m, D]`` (post-RoPE).

        With attention statistics, ``prompt_scores`` holds each kept position's attention per covered query
        row (``stats.kept_prompt_scores``). Layers whose budget is m are passed through untouched (the same
        tensors, made contiguous if they are not), so ``alpha >= 1`` and the ``full`` policy return the cache
        bitwise unchanged (but a sliding layer, cut to its last positions: ``plan``'s ``windows``). ``question``: as for
        ``query_start``.
        """
        kept = self.plan(
            stats_per_layer,
            keys_per_layer,
            values_per_layer,
            alpha=alpha,
            m=m,
            tau=tau,
            question=question,
            windows=windows,
        )
        scores = None
        if self.requires_stats and not self.is_full(alpha):  # plan checked the statistics
            rows = m - self.query_start(m, tau, question)
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
