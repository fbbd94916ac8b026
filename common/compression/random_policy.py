"""Random eviction (a floor for the other policies): uniform random scores, seeded and deterministic.

No statistics needed. The same (seed, layer, H_kv, m) always keeps the same tokens. Uniform budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike


@dataclass
class RandomPolicy(Policy):
    """seed: base seed; layer l draws from ``torch.Generator().manual_seed(seed * 1_000_003 + l)``."""

    name = "random"
    scores_need_stats = False
    seed: int = 0

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """``[H_kv, m]`` i.i.d. uniform scores, drawn on the CPU then moved to the keys' device."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        return torch.rand(keys.shape[0], m, generator=gen).to(keys.device)
