"""KV cache compression policies (VL-Cache and baselines) and layer budget allocators.

See README.md in this folder. Typical use on the prefill worker::

    policy = get_policy("vlcache", allocator=None, exact_budget=False)
    q0 = policy.query_start(m, tau)  # statistics rows q0 .. m-1 in every layer
    compact = policy.compress(stats, keys, values, alpha=0.1, m=m, tau=tau, first_token=tok)
"""

from .base import ALLOCATORS, TAU0_WINDOW, Policy, post_vision_start, recent_count
from .budgets import (
    cake_budgets,
    cake_preferences,
    fit_total,
    pyramid_budgets,
    realized_ratio,
    sparsity_budgets,
    uniform_budgets,
)
from .registry import DEFAULT_POLICY, POLICY_NAMES, get_policy
from .stats import AttentionStatsLike, group_sum, head_sparsity, layer_sparsity

__all__ = [
    "ALLOCATORS",
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "TAU0_WINDOW",
    "AttentionStatsLike",
    "Policy",
    "cake_budgets",
    "cake_preferences",
    "fit_total",
    "get_policy",
    "group_sum",
    "head_sparsity",
    "layer_sparsity",
    "post_vision_start",
    "pyramid_budgets",
    "realized_ratio",
    "recent_count",
    "sparsity_budgets",
    "uniform_budgets",
]
