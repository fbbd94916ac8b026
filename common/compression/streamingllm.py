"""StreamingLLM: the first few tokens (attention sinks) plus the most recent ones; no statistics needed.

With budget k the layer keeps ``min(sinks, k - recent)`` sink tokens and fills the rest from the end
of the prompt, so the kept set is ``[0, s) U [m - (k - s), m)``. Uniform layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike


@dataclass
class StreamingLLMPolicy(Policy):
    """sinks: number of leading tokens always kept (default 4)."""

    name = "streamingllm"
    scores_need_stats = False
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """``[H_kv, m]``: sink j scores ``2m - j`` (earlier sinks first), every other token its position."""
        pos = torch.arange(m, device=keys.device, dtype=torch.float32)
        pos[: self.sinks] = 2.0 * m - pos[: self.sinks]
        return pos.expand(keys.shape[0], m)
