"""Layer budget allocators as registered objects: a policy names one, ``Policy.allocate`` looks it up.

An allocator turns ``(stats, alpha, m, L)`` into the per-layer budgets ``k_l`` (``len == L``, each in
``[1, m]``); the arithmetic lives in ``budgets.py``. ``Policy.allocate`` handles ``alpha >= 1`` (every
layer keeps m) before any allocator runs and hands a stats-reading allocator (``needs_stats``) the
statistics of every layer. Adding one: subclass :class:`Allocator`, set ``name``, decorate with
:func:`register_allocator`; ``get_policy(..., allocator=name)`` then accepts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from .budgets import (
    cake_budgets,
    cake_preferences,
    coverage_budgets,
    coverage_counts,
    mixed_budgets,
    pyramid_budgets,
    sparsity_budgets,
    uniform_budgets,
)
from .stats import AttentionStatsLike, layer_sparsity

if TYPE_CHECKING:
    from .base import Policy


class Allocator:
    """Base allocator. ``needs_stats``: whether :meth:`budgets` reads the statistics."""

    name: ClassVar[str] = ""
    needs_stats: ClassVar[bool] = False

    def budgets(
        self, stats: Sequence[AttentionStatsLike] | None, alpha: float, m: int, L: int, policy: Policy
    ) -> list[int]:
        """Budgets ``k_l`` for ``0 < alpha < 1``. stats: one per layer when ``needs_stats``, else None.

        policy: the calling policy, for its allocator parameters (``pyramid_beta``, ``cake_tau1``...).
        """
        raise NotImplementedError


_ALLOCATORS: dict[str, Allocator] = {}


def register_allocator(cls: type[Allocator]) -> type[Allocator]:
    """Class decorator: make ``cls.name`` selectable as a policy's allocator."""
    if not cls.name or cls.name in _ALLOCATORS:
        raise ValueError(f"allocator name {cls.name!r} is empty or already registered")
    _ALLOCATORS[cls.name] = cls()
    return cls


def unregister_allocator(name: str) -> None:
    """Remove a registered allocator (tests and plug-ins)."""
    _ALLOCATORS.pop(name, None)


def allocator_names() -> tuple[str, ...]:
    """Names of the registered allocators, in registration order."""
    return tuple(_ALLOCATORS)


def get_allocator(name: str) -> Allocator:
    """The registered allocator ``name``; ValueError for an unknown one."""
    allocator = _ALLOCATORS.get(name)
    if allocator is None:
        raise ValueError(f"unknown allocator {name!r}; choose from {allocator_names()}")
    return allocator


@register_allocator
class SparsityAllocator(Allocator):
    """VL-Cache Algorithm 1 on the layer sparsities of the policy's rows (``exact_budget`` honoured)."""

    name = "sparsity"
    needs_stats = True

    def budgets(self, stats, alpha, m, L, policy):
        gammas = [layer_sparsity(s) for s in stats]
        return sparsity_budgets(gammas, alpha, m, exact=policy.exact_budget)


@register_allocator
class UniformAllocator(Allocator):
    """``ceil(alpha * m)`` in every layer."""

    name = "uniform"

    def budgets(self, stats, alpha, m, L, policy):
        return uniform_budgets(L, alpha, m)


@register_allocator
class PyramidAllocator(Allocator):
    """PyramidKV, decreasing with depth (``policy.pyramid_beta``)."""

    name = "pyramid"

    def budgets(self, stats, alpha, m, L, policy):
        return pyramid_budgets(L, alpha, m, beta=policy.pyramid_beta)


@register_allocator
class CakeAllocator(Allocator):
    """CAKE, proportional to the entropy/variance preference (``policy.cake_tau1``, ``cake_tau2``)."""

    name = "cake"
    needs_stats = True

    def budgets(self, stats, alpha, m, L, policy):
        prefs = cake_preferences(stats, tau1=policy.cake_tau1, tau2=policy.cake_tau2)
        return cake_budgets(prefs, alpha, m)


@register_allocator
class MixedAllocator(Allocator):
    """``1 - adaptive_weight`` uniform, ``adaptive_weight`` Algorithm 1 (``policy.adaptive_weight``, 0.2)."""

    name = "mixed"
    needs_stats = True

    def budgets(self, stats, alpha, m, L, policy):
        gammas = [layer_sparsity(s) for s in stats]
        return mixed_budgets(gammas, alpha, m, weight=policy.adaptive_weight)


@register_allocator
class CoverageAllocator(Allocator):
    """Proportional to the tokens each layer needs to cover ``policy.coverage_mass`` of its attention,
    at least ``policy.min_layer_share`` of the uniform budget per layer."""

    name = "coverage"
    needs_stats = True

    def budgets(self, stats, alpha, m, L, policy):
        counts = coverage_counts(stats, mass=policy.coverage_mass)
        return coverage_budgets(counts, alpha, m, floor_share=policy.min_layer_share)


ALLOCATORS: tuple[str, ...] = allocator_names()  # the built-in allocators
