"""VL-Cache (paper 001, section 4): post-vision attention scores with sparsity-aware layer budgets.

Statistics: rows ``m - tau .. m-1`` (the language tokens after the last vision token); with tau = 0 the
last ``min(m, 8)`` rows (see ``base.post_vision_start``). A text-only prompt has tau = m, so every row
is post-vision and the score becomes H2O's accumulated attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class VLCachePolicy(Policy):
    """Score = column sums of the post-vision softmax, summed over the query heads of a KV group
    (the base ``score`` and ``query_start``).

    Budgets default to Algorithm 1 on the post-vision layer sparsity gamma_l = mean_h below_h / unmasked_h.
    """

    name = "vlcache"
    allocator: str = "sparsity"
    post_vision_window: bool = True
