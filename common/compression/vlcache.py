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

    Defaults chosen on the model zoo by the tuning protocol (``common/compression/README.md``): the
    post-vision window keeps the question's last tokens (up to half the budget), scores are max-pooled over
    3 positions, and layer budgets decrease gently with depth (``pyramid``, beta 4).
    Algorithm 1 on the post-vision layer sparsity gamma_l = mean_h below_h / unmasked_h is
    ``allocator="sparsity"``; the paper's policy as first shipped is ``tools/eval/zoo.py``
    ``PREVIOUS_DEFAULT``.
    """

    name = "vlcache"
    allocator: str = "pyramid"
    pyramid_beta: float = 4.0
    pool_kernel: int = 3
    post_vision_window: bool = True
