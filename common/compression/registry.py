"""Policy names as a request names them (``CompressionParams.policy``), how to build one, and a request's
validated choice (:class:`CompressionSettings`: policy, allocator, budget alpha, threshold p).

The settings validate themselves on construction (ValueError with a message fit for the client; the proto
adapter at each process's edge is ``vlkv.common.request.compression_from_proto``), build the policy, and
estimate the per-layer kept tokens before the prefill runs (for admission). A policy also comes from a
plain JSON dict (:func:`policy_from_dict`, the shape ``Policy.to_dict`` writes and a compression profile
stores)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .allocators import Allocator, allocator_class, allocator_from_dict, allocator_names
from .base import Policy
from .full import FullPolicy
from .h2o import H2OPolicy
from .pyramidkv import PyramidKVPolicy
from .random_policy import RandomPolicy
from .serialize import fields_from_dict
from .snapkv import SnapKVPolicy
from .streamingllm import StreamingLLMPolicy
from .verify_checks import check_cap, check_floor, check_mode
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

# The flat spelling of allocator parameters (policy keywords before allocators held their own), still
# accepted by get_policy: keyword -> (allocator name, field). Applied when the policy's allocator is of that
# kind, validated and ignored otherwise (as before).
FLAT_ALLOCATOR_PARAMS: dict[str, tuple[str, str]] = {
    "exact_budget": ("sparsity", "exact"),
    "pyramid_beta": ("pyramid", "beta"),
    "cake_tau1": ("cake", "tau1"),
    "cake_tau2": ("cake", "tau2"),
    "adaptive_weight": ("mixed", "weight"),
    "coverage_mass": ("coverage", "mass"),
    "min_layer_share": ("coverage", "floor_share"),
}


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name`` (empty = vlcache); ValueError for an unknown one."""
    cls = _POLICIES.get(name or DEFAULT_POLICY)
    if cls is None:
        raise ValueError(f"unknown compression policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return cls


def _own_allocator(cls: type[Policy]) -> Allocator:
    return next(f.default for f in dataclasses.fields(cls) if f.name == "allocator")


def resolve_allocator(cls: type[Policy], allocator: str | dict | Allocator | None) -> Allocator:
    """The allocator a policy of class ``cls`` runs with: its own for None / "" or for a name of its own
    allocator's kind (``vlcache`` + ``"pyramid"`` keeps beta 4), the registered default instance for another
    name, the instance itself, or one read from a dict."""
    own = _own_allocator(cls)
    if allocator is None or allocator == "":
        return own
    if isinstance(allocator, Allocator):
        return allocator
    if isinstance(allocator, dict):
        return allocator_from_dict(allocator)
    if isinstance(allocator, str):
        return own if allocator == own.name else allocator_class(allocator)()
    raise ValueError(f"allocator must be a name, a dict or an Allocator, got {allocator!r}")


def get_policy(
    name: str = DEFAULT_POLICY, *, allocator: str | dict | Allocator | None = None, **params: Any
) -> Policy:
    """Build policy ``name`` (empty = vlcache) with dataclass ``params``.

    allocator: a registered name, an ``Allocator`` or its dict (see :func:`resolve_allocator`); None or ""
    keeps the policy's own. The flat allocator keywords (``pyramid_beta=2.0``, ``exact_budget=True``:
    ``FLAT_ALLOCATOR_PARAMS``) set that allocator's field. Unknown names or parameters raise ValueError.
    """
    cls = policy_class(name)
    chosen = resolve_allocator(cls, allocator)
    for key in [k for k in params if k in FLAT_ALLOCATOR_PARAMS]:
        owner, field = FLAT_ALLOCATOR_PARAMS[key]
        value = params.pop(key)
        try:
            if chosen.name == owner:
                chosen = chosen.replace(**{field: value})
            else:
                allocator_class(owner)(**{field: value})  # checked, not used (another allocator runs)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    try:
        return cls(allocator=chosen, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err


def policy_from_dict(data: Any) -> Policy:
    """A policy from ``{"policy": name, "allocator": {...}, <option>: value}`` (``Policy.to_dict``'s shape;
    only ``policy`` is required). ValueError names an unknown policy, allocator or option, a value of the
    wrong type or out of range."""
    if not isinstance(data, dict) or not isinstance(data.get("policy"), str):
        raise ValueError(f"policy: expected an object with a 'policy' name, got {data!r}")
    cls = policy_class(data["policy"])
    rest = {k: v for k, v in data.items() if k not in ("policy", "allocator")}
    params = fields_from_dict(cls, rest, f"policy {cls.name!r}", skip=("allocator",))
    return cls(allocator=resolve_allocator(cls, data.get("allocator")), **params)


DEFAULT_BUDGET = 0.1
DEFAULT_THRESHOLD = 0.01


@dataclass(frozen=True, slots=True)
class CompressionSettings:
    """policy: a registered policy name; budget: alpha in (0, 1]; threshold: p in (0, 1);
    allocator: a registered allocator name, "" = the policy's own; exact_budget: Algorithm 1's exact total
    (``Sparsity(exact=True)``; ignored by the other allocators); lookahead / lookahead_weight: the policy's
    draft-query options (``Policy.lookahead``; None: the policy's own); explicit: False when the request named no
    policy, allocator nor exact budget (the server's compression profile, if any, then chooses the policy:
    ``profile.CompressionProfile.policy_for``). verify / fidelity_floor / max_budget: verified compression
    (``verify.py``; None: the server's default)."""

    policy: str = DEFAULT_POLICY
    budget: float = DEFAULT_BUDGET
    threshold: float = DEFAULT_THRESHOLD
    allocator: str = ""
    exact_budget: bool = False
    explicit: bool = True
    lookahead: int | None = None
    lookahead_weight: float | None = None
    verify: str | None = None
    fidelity_floor: float | None = None
    max_budget: float | None = None

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
        if self.verify is not None:
            check_mode(self.verify)
        if self.fidelity_floor is not None:
            check_floor(self.fidelity_floor)
        if self.max_budget is not None:
            check_cap(self.max_budget)
        self.build_policy()  # policy-level checks (ValueError)

    @property
    def is_full(self) -> bool:
        """Whether the whole cache is kept (the ``full`` policy or budget >= 1); see ``Policy.is_full``."""
        return self.build_policy().is_full(self.budget)

    def build_policy(self) -> Policy:
        """The configured policy (allocator override and ``exact_budget`` applied)."""
        extra = {
            k: v
            for k, v in (("lookahead", self.lookahead), ("lookahead_weight", self.lookahead_weight))
            if v is not None
        }
        return get_policy(
            self.policy, allocator=self.allocator or None, exact_budget=self.exact_budget, **extra
        )

    def layer_tokens_estimate(self, m: int, num_layers: int) -> list[int]:
        """Per-layer kept tokens for admission, before the prefill: m when full, else ``ceil(budget * m)``
        (at most m) in every layer; the allocator's real budgets may move tokens between layers."""
        kept = m if self.is_full else min(m, math.ceil(self.budget * m))
        return [kept] * num_layers
