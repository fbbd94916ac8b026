"""StreamingLLM: the first few tokens (attention sinks) plus the most recent ones; no statistics needed.

The sinks are the shared ``sink_tokens`` option (``selection.py``: kept earliest first, as far as the
budget allows); the score is recency. With budget k the layer keeps ``min(sinks, k - recent)`` sink tokens
and fills the rest from the end of the prompt, so the kept set is ``[0, s) U [m - (k - s), m)``. Uniform
layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy
from .stats import AttentionStatsLike


@dataclass
class StreamingLLMPolicy(Policy):
    """sink_tokens: number of leading tokens always kept (default 4)."""

    name = "streamingllm"
    scores_need_stats = False
    sink_tokens: int = 4

    def score(
        self,
        layer: int,
        stats: AttentionStatsLike | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        m: int,
        tau: int,
    ) -> torch.Tensor:
        """``[H_kv, m]``: every token scores its position (the most recent win)."""
        pos = torch.arange(m, device=keys.device, dtype=torch.float32)
        return pos.expand(keys.shape[0], m)
