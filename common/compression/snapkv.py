"""SnapKV: attention from a fixed observation window of the last w prompt rows, max-pooled over positions.

Pooling keeps the neighbours of a strongly attended token, so kept tokens come in small clusters.
Statistics: rows ``m - min(m, w) .. m-1``, independent of tau. Uniform layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Policy
from .stats import AttentionStatsLike, group_sum


def pooled_window_scores(col_sum: torch.Tensor, num_kv_heads: int, kernel: int) -> torch.Tensor:
    """Max-pool each query head's column sums ``[H, m]`` along positions (stride 1, same length), then
    sum within GQA groups -> ``[H_kv, m]``."""
    if kernel > 1:
        col_sum = F.max_pool1d(col_sum.float().unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    return group_sum(col_sum.float(), num_kv_heads)


@dataclass
class SnapKVPolicy(Policy):
    """window: observation rows w (default 8); pool_kernel: odd max-pool width (default 7, 1 = none)."""

    name = "snapkv"
    window: int = 8
    pool_kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd number, got {self.pool_kernel}")

    def query_start(self, m: int, tau: int) -> int:
        """The last ``min(m, window)`` rows."""
        return m - min(m, self.window)

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """``[H_kv, m]`` pooled window attention from stats.col_sum ``[H, m]``."""
        assert stats is not None
        return pooled_window_scores(stats.col_sum, keys.shape[0], self.pool_kernel)
