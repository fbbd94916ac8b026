"""KV cache compression policies (VL-Cache and baselines), layer budget allocators, presets, request
settings.

See README.md in this folder. Typical use on the prefill worker::

    policy = CompressionSettings("vlcache", budget=0.1).build_policy()
    q0 = policy.query_start(m, tau)  # statistics rows q0 .. m-1 in every layer
    compact = policy.compress(stats, keys, values, alpha=0.1, m=m, tau=tau, first_token=tok)
"""

from .allocators import (
    ALLOCATORS,
    Allocator,
    Cake,
    Coverage,
    DraftMass,
    Mixed,
    Pyramid,
    Sparsity,
    Uniform,
    allocator_from_dict,
    allocator_names,
    get_allocator,
    register_allocator,
    unregister_allocator,
)
from .base import TAU0_WINDOW, Policy, post_vision_start, recent_count
from .budgets import (
    cake_budgets,
    cake_preferences,
    coverage_budgets,
    coverage_counts,
    fit_total,
    mixed_budgets,
    pyramid_budgets,
    realized_ratio,
    sparsity_budgets,
    uniform_budgets,
)
from .presets import PRESETS
from .registry import (
    DEFAULT_BUDGET,
    DEFAULT_POLICY,
    DEFAULT_THRESHOLD,
    POLICY_NAMES,
    CompressionSettings,
    get_policy,
    policy_from_dict,
    policy_names,
    preset,
    preset_params,
    register_policy,
    register_preset,
)
from .routing import AnyPolicy, ByBudget, ByPromptKind
from .stats import AttentionStatsLike, group_sum, head_sparsity, layer_sparsity, rows_seeing

__all__ = [
    "ALLOCATORS",
    "AnyPolicy",
    "ByBudget",
    "ByPromptKind",
    "DEFAULT_BUDGET",
    "DEFAULT_POLICY",
    "DEFAULT_THRESHOLD",
    "POLICY_NAMES",
    "PRESETS",
    "TAU0_WINDOW",
    "Allocator",
    "AttentionStatsLike",
    "Cake",
    "CompressionSettings",
    "Coverage",
    "DraftMass",
    "Mixed",
    "Policy",
    "Pyramid",
    "Sparsity",
    "Uniform",
    "allocator_from_dict",
    "allocator_names",
    "cake_budgets",
    "cake_preferences",
    "coverage_budgets",
    "coverage_counts",
    "fit_total",
    "get_allocator",
    "get_policy",
    "group_sum",
    "head_sparsity",
    "layer_sparsity",
    "mixed_budgets",
    "policy_from_dict",
    "policy_names",
    "post_vision_start",
    "preset",
    "preset_params",
    "pyramid_budgets",
    "realized_ratio",
    "recent_count",
    "register_allocator",
    "register_policy",
    "register_preset",
    "rows_seeing",
    "sparsity_budgets",
    "uniform_budgets",
    "unregister_allocator",
]
