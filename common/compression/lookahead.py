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
rows' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
