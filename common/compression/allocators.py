"""Layer budget allocators: small frozen dataclasses that hold their own parameters.

An allocator turns ``(stats, alpha, m, L)`` into the per-layer budgets ``k_l`` (``len == L``, each in
``[1, m]``); the arithmetic lives in ``budgets.py``. A policy holds one (``Policy.allocator``, e.g.
``Pyramid(beta=4.0)``); ``Policy.allocate`` handles ``alpha >= 1`` (every layer keeps m) before any
allocator runs and hands a stats-reading allocator (``needs_stats``) the statistics of every layer.

A request names an allocator by its registered name (``CompressionParams.allocator``): the name maps to
the class's default instance (:func:`get_allocator`), or keeps the policy's own instance when it is of that
kind (``registry.get_policy``). Each one serializes to ``{"name": ..., <its fields>}`` and back
(:func:`allocator_from_dict`, validated). Adding one: a ``@dataclass(frozen=True)`` subclass of
:class:`Allocator` with a ``name``, ``budgets`` and range checks in ``__post_init__``, decorated with
:func:`register_allocator`; every policy then accepts it by name or as an instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from .budgets import (
    cake_budgets,
    cake_preferences,
    coverage_budgets,
    coverage_counts,
    fit_total,
    mixed_budgets,
    pyramid_budgets,
    raise_to_floors,
    sparsity_budgets,
    uniform_budgets,
)
from .lookahead import draft_gains, draft_mass_budgets
from .serialize import fields_from_dict, fields_to_dict
from .stats import AttentionStatsLike, layer_sparsity


@dataclass(frozen=True)
class Allocator:
    """Base allocator. ``needs_stats``: whether :meth:`budgets` reads the statistics."""

    name: ClassVar[str] = ""
    needs_stats: ClassVar[bool] = False

    def budgets(self, stats: Sequence[AttentionStatsLike] | None, alpha: float, m: int, L: int) -> list[int]:
        """Budgets ``k_l`` for ``0 < alpha < 1``. stats: one per layer when ``needs_stats``, else None."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., <field>: value, ...}``, plain JSON."""
        return {"name": self.name, **fields_to_dict(self)}

    def replace(self, **changes: Any) -> Allocator:
        """A copy with ``changes`` (validated like the constructor)."""
        return replace(self, **changes)


_ALLOCATORS: dict[str, type[Allocator]] = {}


def register_allocator(cls: type[Allocator]) -> type[Allocator]:
    """Class decorator: make ``cls.name`` selectable as a policy's allocator."""
    if not cls.name or cls.name in _ALLOCATORS:
        raise ValueError(f"allocator name {cls.name!r} is empty or already registered")
    _ALLOCATORS[cls.name] = cls
    return cls


def unregister_allocator(name: str) -> None:
    """Remove a registered allocator (tests and plug-ins)."""
    _ALLOCATORS.pop(name, None)


def allocator_names() -> tuple[str, ...]:
    """Names of the registered allocators, in registration order."""
    return tuple(_ALLOCATORS)


def allocator_class(name: str) -> type[Allocator]:
    """The registered allocator class ``name``; ValueError for an unknown one."""
    cls = _ALLOCATORS.get(name)
    if cls is None:
        raise ValueError(f"unknown allocator {name!r}; choose from {', '.join(allocator_names())}")
    return cls


def get_allocator(name: str) -> Allocator:
    """The default instance of the registered allocator ``name`` (what a request's name maps to)."""
    return allocator_class(name)()


def allocator_from_dict(data: Any) -> Allocator:
    """An allocator from ``{"name": ..., <fields>}``; ValueError for an unknown name, key or bad value."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError(f"allocator: expected an object with a 'name', got {data!r}")
    cls = allocator_class(data["name"])
    rest = {k: v for k, v in data.items() if k != "name"}
    return cls(**fields_from_dict(cls, rest, f"allocator {cls.name!r}"))


def _unit(owner: str, field: str, value: float, low_open: bool = False) -> None:
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise ValueError(f"{owner} {field} must be in {interval}, got {value}")


@register_allocator
@dataclass(frozen=True)
class Sparsity(Allocator):
    """VL-Cache Algorithm 1 on the layer sparsities of the policy's rows. exact: hit
    ``round(alpha * L * m)`` in total (``budgets.sparsity_budgets``)."""

    name = "sparsity"
    needs_stats = True
    exact: bool = False

    def budgets(self, stats, alpha, m, L):
        return sparsity_budgets([layer_sparsity(s) for s in stats], alpha, m, exact=self.exact)


@register_allocator
@dataclass(frozen=True)
class Uniform(Allocator):
    """``ceil(alpha * m)`` in every layer."""

    name = "uniform"

    def budgets(self, stats, alpha, m, L):
        return uniform_budgets(L, alpha, m)


@register_allocator
@dataclass(frozen=True)
class Pyramid(Allocator):
    """PyramidKV, decreasing with depth: the last layer ``1 / beta`` of the mean (``beta >= 1``)."""

    name = "pyramid"
    beta: float = 20.0

    def __post_init__(self) -> None:
        if not self.beta >= 1.0:
            raise ValueError(f"pyramid beta must be >= 1, got {self.beta}")

    def budgets(self, stats, alpha, m, L):
        return pyramid_budgets(L, alpha, m, beta=self.beta)


@register_allocator
@dataclass(frozen=True)
class Cake(Allocator):
    """CAKE, proportional to ``H_l^(1/tau1) * V_l^(1/tau2)`` (``budgets.cake_preferences``)."""

    name = "cake"
    needs_stats = True
    tau1: float = 1.0
    tau2: float = 1.0

    def __post_init__(self) -> None:
        if not (self.tau1 > 0 and self.tau2 > 0):
            raise ValueError(f"cake tau1 and tau2 must be > 0, got {self.tau1}, {self.tau2}")

    def budgets(self, stats, alpha, m, L):
        return cake_budgets(cake_preferences(stats, tau1=self.tau1, tau2=self.tau2), alpha, m)


@register_allocator
@dataclass(frozen=True)
class Mixed(Allocator):
    """``1 - weight`` of the uniform total split evenly, ``weight`` by Algorithm 1's shares."""

    name = "mixed"
    needs_stats = True
    weight: float = 0.2

    def __post_init__(self) -> None:
        _unit("mixed", "weight", self.weight)

    def budgets(self, stats, alpha, m, L):
        return mixed_budgets([layer_sparsity(s) for s in stats], alpha, m, weight=self.weight)


@register_allocator
@dataclass(frozen=True)
class Coverage(Allocator):
    """Proportional to the keys each layer needs to cover ``mass`` of its window attention, every layer at
    least ``floor_share`` of the uniform budget."""

    name = "coverage"
    needs_stats = True
    mass: float = 0.9
    floor_share: float = 0.25

    def __post_init__(self) -> None:
        _unit("coverage", "mass", self.mass, low_open=True)
        _unit("coverage", "floor_share", self.floor_share)

    def budgets(self, stats, alpha, m, L):
        counts = coverage_counts(stats, mass=self.mass)
        return coverage_budgets(counts, alpha, m, floor_share=self.floor_share)


@register_allocator
@dataclass(frozen=True)
class DraftMass(Allocator):
    """Layer budgets by the lookahead draft's attention (``lookahead.py``), in the spirit of the oracle's own
    budgets: ``weight`` of the total goes where the draft's attention mass is best covered (greedy marginal
    gains over all layers, :func:`lookahead.draft_mass_budgets`), ``1 - weight`` as ``Pyramid(beta)``; the
    blend is fitted to the same total under ``[1, m]``. Without draft rows (``lookahead`` 0, a draft that
    ended at once, a policy that drafts nothing) it is ``Pyramid(beta)`` exactly.

    floor_layers: the first n layers keep at least their ``Pyramid(beta)`` budget (the draft's split starts
    them there and spends the rest by the gains; the blend and its fit keep them there); 0, the default, is
    the plain rule, the same budgets; n >= L is ``Pyramid(beta)``. Serialized only when not 0."""

    name = "draft_mass"
    needs_stats = True
    weight: float = 0.5
    beta: float = 4.0
    floor_layers: int = 0

    def __post_init__(self) -> None:
        _unit("draft_mass", "weight", self.weight)
        if not self.beta >= 1.0:
            raise ValueError(f"draft_mass beta must be >= 1, got {self.beta}")
        if (
            isinstance(self.floor_layers, bool)
            or not isinstance(self.floor_layers, int)
            or self.floor_layers < 0
        ):
            raise ValueError(f"draft_mass floor_layers must be an integer >= 0, got {self.floor_layers!r}")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.floor_layers == 0:  # files and profiles written before the field read the same
            del data["floor_layers"]
        return data

    def budgets(self, stats, alpha, m, L):
        pyramid = pyramid_budgets(L, alpha, m, beta=self.beta)
        gains = draft_gains(stats)
        if gains is None or self.weight == 0.0:
            return pyramid
        total = sum(pyramid)
        if gains.shape != (L, m):
            raise ValueError(f"draft gains {tuple(gains.shape)} are not [L={L}, m={m}]")
        if self.floor_layers == 0:
            draft = draft_mass_budgets(gains, total)
            floors = None
        else:
            n = min(self.floor_layers, L)
            floors = pyramid[:n] + [1] * (L - n)
            draft = draft_mass_budgets(gains, total, floors=floors)
        if self.weight == 1.0:
            return draft
        blend = [(1.0 - self.weight) * p + self.weight * d for p, d in zip(pyramid, draft, strict=True)]
        fitted = fit_total(blend, total, 1, m)
        return fitted if floors is None else raise_to_floors(fitted, floors)


ALLOCATORS: tuple[str, ...] = allocator_names()  # the built-in allocators
