"""Wrapper policies: a prompt handed to one of several policy objects, by its kind or by the budget.

:class:`ByPromptKind` compresses prompts with vision tokens with ``image`` and text-only prompts (``tau >= m``)
with ``text``; :class:`ByBudget` compresses with ``low`` below the budget ``below`` and with ``high`` at and
above it. A wrapper holds policies, never names (a preset's name is resolved where requests are,
``registry.py``), and answers what the prefill worker asks of a policy (``query_start``, ``requires_stats``,
``lookahead_steps``, ``compress``) by asking the policy its ``for_prompt`` hands the prompt to.

A prompt's statistics are taken once, before the budget is applied: the two halves of a ``ByBudget`` read
the same statistics rows (checked), so the rows a prompt needs do not depend on the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vlkv.common.handoff.compact_kv import CompactKV

from .base import Policy

__all__ = ["AnyPolicy", "ByBudget", "ByPromptKind"]


class _Routed:
    """What a wrapper answers for the policy that compresses the prompt (``for_prompt``). What the prompt's
    kind and the budget do not decide (an option, ``allocate``, ``score``, ``select``) is its primary
    policy's: ``ByPromptKind.image``'s, ``ByBudget.high``'s, as the policy a request named."""

    always_full = False
    _primary = ""  # the field holding the primary policy

    def __getattr__(self, name: str) -> Any:
        primary = self.__dict__.get(self._primary)
        if name.startswith("__") or primary is None:
            raise AttributeError(name)
        return getattr(primary, name)

    def members(self) -> tuple[Policy, ...]:
        raise NotImplementedError

    def for_prompt(self, m: int, tau: int, alpha: float | None = None) -> Policy:
        raise NotImplementedError

    def is_full(self, alpha: float) -> bool:
        """Whether budget ``alpha`` keeps the whole cache for every prompt."""
        return alpha >= 1.0 or all(p.always_full for p in self.members())

    @property
    def requires_stats(self) -> bool:
        """Whether some prompt's policy reads attention statistics below full budget."""
        return any(p.requires_stats for p in self.members())

    def query_start(self, m: int, tau: int, question: int = 0) -> int:
        return self.for_prompt(m, tau).query_start(m, tau, question)

    def observed_tau(self, m: int, tau: int, question: int = 0) -> int:
        return self.for_prompt(m, tau).observed_tau(m, tau, question)

    def lookahead_steps(self, alpha: float, m: int, tau: int) -> int:
        return self.for_prompt(m, tau, alpha).lookahead_steps(alpha, m, tau)

    def plan(self, *args: Any, alpha: float, m: int, tau: int, **kwargs: Any) -> list[torch.Tensor]:
        """``Policy.plan`` of the policy ``for_prompt`` hands the prompt to (the same arguments)."""
        return self.for_prompt(m, tau, alpha).plan(*args, alpha=alpha, m=m, tau=tau, **kwargs)

    def compress(self, *args: Any, alpha: float, m: int, tau: int, **kwargs: Any) -> CompactKV:
        """``Policy.compress`` of the policy ``for_prompt`` hands the prompt to (the same arguments)."""
        return self.for_prompt(m, tau, alpha).compress(*args, alpha=alpha, m=m, tau=tau, **kwargs)


@dataclass(frozen=True)
class ByBudget(_Routed):
    """``low`` compresses below budget ``below`` (0 < below < 1), ``high`` at and above it. Both are plain
    policies that read the same statistics rows (the same ``query_start`` and text-window options)."""

    high: Policy
    low: Policy
    below: float
    _primary = "high"

    def __post_init__(self) -> None:
        if not (isinstance(self.high, Policy) and isinstance(self.low, Policy)):
            raise ValueError("by_budget: high and low must be plain policies (not wrappers)")
        if not 0.0 < self.below < 1.0:
            raise ValueError(f"by_budget: below must be in (0, 1), got {self.below}")
        same_rows = (
            type(self.low).query_start is type(self.high).query_start
            and self.low.rows_options() == self.high.rows_options()
        )
        if not same_rows:
            raise ValueError(
                f"by_budget: {self.low.name} (low) reads other statistics rows than {self.high.name} (high): "
                "their query_start and observation-window options (rows_options) must be the same"
            )

    def members(self) -> tuple[Policy, ...]:
        return (self.high, self.low)

    def for_prompt(self, m: int, tau: int, alpha: float | None = None) -> Policy:
        """``low`` below ``below``, else ``high`` (``high`` without a budget: the rows are the same)."""
        return self.low if alpha is not None and alpha < self.below else self.high

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": "by_budget",
            "high": self.high.to_dict(),
            "low": self.low.to_dict(),
            "below": self.below,
        }


@dataclass(frozen=True)
class ByPromptKind(_Routed):
    """``image`` compresses prompts with vision tokens (``tau < m``), ``text`` text-only prompts; each a plain
    policy or a :class:`ByBudget`. Its ``name`` is ``image``'s (the policy a request named)."""

    image: Policy | ByBudget
    text: Policy | ByBudget
    _primary = "image"

    def __post_init__(self) -> None:
        for role in ("image", "text"):
            if not isinstance(getattr(self, role), Policy | ByBudget):
                raise ValueError(f"by_prompt_kind: {role} must be a policy or a by_budget wrapper")

    def members(self) -> tuple[Policy, ...]:
        return tuple(
            p
            for part in (self.image, self.text)
            for p in (part.members() if isinstance(part, ByBudget) else (part,))
        )

    def for_prompt(self, m: int, tau: int, alpha: float | None = None) -> Policy:
        return (self.text if tau >= m else self.image).for_prompt(m, tau, alpha)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": "by_prompt_kind", "image": self.image.to_dict(), "text": self.text.to_dict()}


AnyPolicy = Policy | ByBudget | ByPromptKind
"""What compresses a request: a plain policy or a wrapper of them."""
