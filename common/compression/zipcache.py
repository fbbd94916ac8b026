"""ZipCache-style normalized attention: accumulated attention divided by how many queries saw the token.

Accumulated attention favours early tokens (more rows can see them); dividing column j by its number of
unmasked entries ``n_j`` removes that length bias. Statistics: all rows (``query_start = 0``); with a
partial window ``q0 .. m-1`` the count is ``n_j = m - max(j, q0)``. Uniform layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike, group_sum, num_query_rows


def visible_rows(m: int, q_start: int, device: torch.device | None = None) -> torch.Tensor:
    """``[m]`` number of query rows ``q_start .. m-1`` that can see key j under the causal mask."""
    j = torch.arange(m, device=device)
    return (m - j.clamp_min(q_start)).float()


@dataclass
class ZipCachePolicy(Policy):
    """Score = ``sum_{h in group} col_sum_hj / n_j``."""

    name = "zipcache"

    def query_start(self, m: int, tau: int) -> int:
        """All prompt rows."""
        return 0

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """``[H_kv, m]`` normalized attention from stats.col_sum ``[H, m]``."""
        assert stats is not None
        col_sum = stats.col_sum.float()
        counts = visible_rows(m, m - num_query_rows(stats), col_sum.device)
        return group_sum(col_sum / counts, keys.shape[0])
