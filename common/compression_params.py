"""Compression parameters of a request, validated where they enter (gateway and prefill worker)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlkv.common.compression.base import ALLOCATORS
from vlkv.common.compression.registry import DEFAULT_POLICY, POLICY_NAMES, get_policy
from vlkv.common.errors import InvalidInput
from vlkv.v1 import generate_pb2

DEFAULT_BUDGET = 0.1
DEFAULT_THRESHOLD = 0.01


@dataclass(frozen=True, slots=True)
class CompressionConfig:
    policy: str = DEFAULT_POLICY
    budget: float = DEFAULT_BUDGET
    threshold: float = DEFAULT_THRESHOLD
    allocator: str = ""
    exact_budget: bool = False

    @property
    def is_full(self) -> bool:
        return self.policy == "full" or self.budget >= 1.0

    def build_policy(self):
        return get_policy(self.policy, allocator=self.allocator or None, exact_budget=self.exact_budget)


def compression_from_proto(pb: generate_pb2.CompressionParams) -> CompressionConfig:
    policy = pb.policy or DEFAULT_POLICY
    if policy not in POLICY_NAMES:
        raise InvalidInput(f"unknown compression policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
    budget = pb.budget if pb.HasField("budget") else DEFAULT_BUDGET
    if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
        raise InvalidInput(f"compression budget must be in (0, 1], got {budget}")
    threshold = pb.threshold if pb.HasField("threshold") else DEFAULT_THRESHOLD
    if not (math.isfinite(threshold) and 0.0 < threshold < 1.0):
        raise InvalidInput(f"compression threshold must be in (0, 1), got {threshold}")
    if pb.allocator and pb.allocator not in ALLOCATORS:
        raise InvalidInput(f"unknown allocator {pb.allocator!r}; choose from {', '.join(ALLOCATORS)}")
    cfg = CompressionConfig(policy, float(budget), float(threshold), pb.allocator, pb.exact_budget)
    try:
        cfg.build_policy()
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return cfg
