"""No compression: every layer keeps all m tokens; the cache is handed on bitwise unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike


@dataclass
class FullPolicy(Policy):
    """Budgets are m in every layer whatever alpha and allocator; no statistics needed."""

    name = "full"
    scores_need_stats = False

    @property
    def requires_stats(self) -> bool:
        return False

    def allocate(
        self, stats_per_layer: Sequence[AttentionStatsLike | None] | None, alpha: float, m: int, L: int
    ) -> list[int]:
        """``[m] * L``."""
        return [m] * L

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """Never called (every layer is full); zeros ``[H_kv, m]``."""
        return torch.zeros(keys.shape[0], m, device=keys.device)
