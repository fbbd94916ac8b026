"""Policy names as a request names them (``CompressionParams.policy``), how to build one, and a request's
validated choice (:class:`CompressionSettings`: policy, allocator, budget alpha, threshold p).

The settings validate themselves on construction (ValueError with a message fit for the client; the proto
adapter at each process's edge is ``vlkv.common.request.compression_from_proto``), build the policy, and
estimate the per-layer kept tokens before the prefill runs (for admission)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .allocators import allocator_names
from .base import Policy
from .full import FullPolicy
from .h2o import H2OPolicy
from .pyramidkv import PyramidKVPolicy
from .random_policy import RandomPolicy
from .snapkv import SnapKVPolicy
from .streamingllm import StreamingLLMPolicy
from .vlcache import VLCachePolicy
from .zipcache import ZipCachePolicy

_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        VLCachePolicy,
        StreamingLLMPolicy,
        H2OPolicy,
        ZipCachePolicy,
        SnapKVPolicy,
        PyramidKVPolicy,
        RandomPolicy,
        FullPolicy,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = "vlcache"


def get_policy(name: str = DEFAULT_POLICY, *, allocator: str | None = None, **params: Any) -> Policy:
    """Build policy ``name`` (empty = vlcache) with dataclass ``params``.

    allocator: a registered allocator name (``allocators.allocator_names()``); None or "" keeps the
    policy's own.
    Unknown names or parameters raise ValueError.
    """
    cls = _POLICIES.get(name or DEFAULT_POLICY)
    if cls is None:
        raise ValueError(f"unknown compression policy {name!r}; choose from {POLICY_NAMES}")
    if allocator:
        params["allocator"] = allocator
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


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
