"""H2O (heavy hitters): accumulated attention over every prompt query row, uniform layer budgets.

Statistics: all rows, ``query_start = 0`` (O(m^2) work in the statistics kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike, group_sum


@dataclass
class H2OPolicy(Policy):
    """Score = ``sum_{h in group} sum_{i=0}^{m-1} A_hij`` (causal softmax over the whole prompt)."""

    name = "h2o"

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
        """``[H_kv, m]`` accumulated attention from stats.col_sum ``[H, m]``."""
        assert stats is not None
        return group_sum(stats.col_sum.float(), keys.shape[0])
