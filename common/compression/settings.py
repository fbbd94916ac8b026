"""A request's compression settings, validated where they enter (no protobuf here).

``CompressionSettings`` is what the gateway and the prefill worker carry for one request: the policy and
allocator by name, the budget alpha and the ThresholdFilter p. It validates itself on construction
(ValueError with a message fit for the client), builds the policy, and estimates the per-layer kept
tokens before the prefill runs (for admission). The proto adapter is
``vlkv.common.request.compression_from_proto``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .allocators import allocator_names
from .base import Policy
from .registry import DEFAULT_POLICY, POLICY_NAMES, get_policy

DEFAULT_BUDGET = 0.1
DEFAULT_THRESHOLD = 0.01


@dataclass(frozen=True, slots=True)
class CompressionSettings:
    """policy: a registered policy name; budget: alpha in (0, 1]; threshold: p in (0, 1);
    allocator: a registered allocator name, "" = the policy's own; exact_budget: see ``budgets.py``."""

    policy: str = DEFAULT_POLICY
    budget: float = DEFAULT_BUDGET
    threshold: float = DEFAULT_THRESHOLD
    allocator: str = ""
    exact_budget: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            names = ", ".join(POLICY_NAMES)
            raise ValueError(f"unknown compression policy {self.policy!r}; choose from {names}")
        if not (math.isfinite(self.budget) and 0.0 < self.budget <= 1.0):
            raise ValueError(f"compression budget must be in (0, 1], got {self.budget}")
        if not (math.isfinite(self.threshold) and 0.0 < self.threshold < 1.0):
            raise ValueError(f"compression threshold must be in (0, 1), got {self.threshold}")
        if self.allocator and self.allocator not in allocator_names():
            names = ", ".join(allocator_names())
            raise ValueError(f"unknown allocator {self.allocator!r}; choose from {names}")
        self.build_policy()  # policy-level checks (ValueError)

    @property
    def is_full(self) -> bool:
        """Whether the whole cache is kept (the ``full`` policy or budget >= 1); see ``Policy.is_full``."""
        return self.build_policy().is_full(self.budget)

    def build_policy(self) -> Policy:
        """The configured policy (allocator override and ``exact_budget`` applied)."""
        return get_policy(self.policy, allocator=self.allocator or None, exact_budget=self.exact_budget)

    def layer_tokens_estimate(self, m: int, num_layers: int) -> list[int]:
        """Per-layer kept tokens for admission, before the prefill: m when full, else ``ceil(budget * m)``
        (at most m) in every layer; the allocator's real budgets may move tokens between layers."""
        kept = m if self.is_full else min(m, math.ceil(self.budget * m))
        return [kept] * num_layers
