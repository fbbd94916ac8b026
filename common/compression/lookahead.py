"""Draft-query ("lookahead") scoring: the attention of a few greedy draft tokens mixed into a policy's scores.

A generic question ("What is the code of the object in the image?") cannot tell, at prefill time, which line
of a long context the answer will copy: the line is chosen while decoding. With ``Policy.lookahead = K`` the
prefill worker, which holds the full cache anyway, decodes K tokens greedily over it
(``prefill_worker/draft_queries.py``), runs the attention-statistics kernel on those draft rows over the
prompt keys, and hands their column sums to the policy beside the question rows' statistics
(:class:`DraftStats`). The draft tokens are then discarded: the decode worker generates every answer token
from the compressed cache. The idea is that of pseudo lookahead queries ("Lookahead Q-Cache", 2025) and of
SpecKV's draft outputs.

The score (``Policy.score``, :func:`mixed_col_sum`): each source is reduced to its mean attention per row,
``(1 - w) * question + w * draft`` with ``w = lookahead_weight``, then shaped as before (pooling, GQA sum,
spans). The allocator (layer budgets, sparsity) and the kept positions' ``prompt_scores`` read the question
rows only: :class:`DraftStats` answers every :class:`~.stats.AttentionStatsLike` attribute with the question
rows' own. The one allocator that reads the draft is ``allocators.DraftMass`` (:func:`draft_gains`,
:func:`draft_mass_budgets`: layer budgets by the draft's attention mass, as the oracle's own budgets by the
answer's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .stats import AttentionStatsLike, num_query_rows, rows_seeing


@dataclass
class DraftStats:
    """One layer's question-row statistics (``base``) plus the draft rows' attention over the m prompt keys.

    draft_col_sum: ``[H, m]`` fp32, summed over the ``draft_rows`` draft rows (each row's softmax runs over
    the prompt and the draft tokens before it, as a decode step's does; only the prompt's columns are kept).
    """

    base: AttentionStatsLike
    draft_col_sum: torch.Tensor
    draft_rows: int

    @cached_property
    def gain(self) -> torch.Tensor:
        """``[m]`` fp64: this layer's row of :func:`draft_gains`, computed once per object (the evaluation
        tools hand one prompt's objects to every candidate and budget, ``Prepared.drafted_stats``)."""
        draft = self.draft_col_sum.detach().to("cpu", torch.float64)
        draft = draft / draft.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        return draft.sort(dim=-1, descending=True).values.mean(dim=0)

    def __getattr__(self, name: str):
        # every statistics attribute (row_max, row_sumexp, col_sum, below, unmasked, optional col_sqsum) is the
        # question rows' own; only the three fields above are the draft's
        if name in ("base", "draft_col_sum", "draft_rows"):
            raise AttributeError(name)
        return getattr(self.base, name)


def with_draft(
    stats_per_layer: Sequence[AttentionStatsLike], draft_col_sums: Sequence[torch.Tensor], rows: int
) -> list[AttentionStatsLike]:
    """Per layer :class:`DraftStats` (the question rows' statistics unchanged when ``rows`` is 0: the draft
    ended at once, at an end-of-sequence first token)."""
    if rows <= 0:
        return list(stats_per_layer)
    if len(draft_col_sums) != len(stats_per_layer):
        raise ValueError(f"{len(draft_col_sums)} draft layers for {len(stats_per_layer)} statistics layers")
    return [DraftStats(s, d, rows) for s, d in zip(stats_per_layer, draft_col_sums, strict=True)]


def mixed_col_sum(
    stats: AttentionStatsLike, m: int, weight: float, row_normalized: bool
) -> torch.Tensor | None:
    """``[H, m]``: ``(1 - weight) * question + weight * draft``, each the mean attention a row pays each key
    (the question's over the rows that see the key when ``row_normalized``, else over all its rows); None
    when ``stats`` carries no draft rows (score as without lookahead)."""
    if not isinstance(stats, DraftStats) or stats.draft_rows <= 0:
        return None
    draft = stats.draft_col_sum.float()
    if draft.shape != stats.col_sum.shape:
        raise ValueError(f"draft col_sum {tuple(draft.shape)} is not {tuple(stats.col_sum.shape)}")
    tq = num_query_rows(stats)
    question = stats.col_sum.float()
    question = question / (rows_seeing(m, tq, question.device) if row_normalized else float(tq))
    return (1.0 - weight) * question + weight * (draft / stats.draft_rows).to(question.device)


def draft_gains(stats_per_layer: Sequence[AttentionStatsLike]) -> torch.Tensor | None:
    """``[L, m]`` fp64: per layer, the draft rows' attention over the prompt, each query head's normalised to
    sum 1 and sorted best first, averaged over the heads: entry ``[l, i]`` is what layer l's ``i + 1``-th kept
    token adds to the share of the draft's attention it covers (non-increasing along a row). None when a layer
    carries no draft rows (``lookahead`` 0, or a draft that ended at once)."""
    rows = []
    for stats in stats_per_layer:
        if not isinstance(stats, DraftStats) or stats.draft_rows <= 0:
            return None
        rows.append(stats.gain)
    return torch.stack(rows) if rows else None


def draft_mass_budgets(gains: torch.Tensor, total: int, floors: Sequence[int] | None = None) -> list[int]:
    """Per-layer budgets, each in ``[1, m]`` and summing to ``total`` (clamped to ``[L, L * m]``), that cover
    the most draft attention (:func:`draft_gains`): one token per layer, then the ``total - L`` largest
    marginal gains over all layers (a stable sort: ties go to the earlier layer, then the earlier slot). The
    gains fall along a row, so this maximises the summed coverage, as the oracle's own budgets do with the
    answer's attention.

    floors: per layer the tokens it starts with instead of one (each clamped to ``[1, m]``; ``total`` is then
    clamped to ``[sum(floors), L * m]``); the rest goes to the largest gains after each layer's floor, so no
    layer ends below its floor. None (or every floor 1) is the plain rule above."""
    layers, m = gains.shape
    if floors is None:
        floors = [1] * layers
    if len(floors) != layers:
        raise ValueError(f"{len(floors)} floors for {layers} layers")
    start = [min(max(int(f), 1), m) for f in floors]
    total = min(max(int(total), sum(start)), layers * m)
    extra = total - sum(start)
    if extra == 0:  # also every m == 1
        return start
    free = torch.arange(m).unsqueeze(0) >= torch.tensor(start).unsqueeze(1)  # [L, m]: slots past the floor
    layer_of = torch.arange(layers).unsqueeze(1).expand(layers, m).masked_select(free)
    order = torch.sort(-gains.masked_select(free), stable=True).indices[:extra]  # row-major: stable ties
    counts = torch.bincount(layer_of[order], minlength=layers)
    return [s + int(c) for s, c in zip(start, counts.tolist(), strict=True)]
