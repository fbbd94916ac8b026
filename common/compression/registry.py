"""Policy names as a request names them (``CompressionParams.policy``), how to build one, and a request's
validated choice (:class:`CompressionSettings`: policy, allocator, budget alpha, threshold p).

The settings validate themselves on construction (ValueError with a message fit for the client; the proto
adapter at each process's edge is ``vlkv.common.request.compression_from_proto``), build the policy, and
estimate the per-layer kept tokens before the prefill runs (for admission). A policy also comes from a
plain JSON dict (:func:`policy_from_dict`, the shape ``Policy.to_dict`` writes and a compression profile
stores) or a preset's name (:func:`preset`, ``presets.py``). This is the one module that resolves names: a
dict's ``text_preset`` / ``low_budget_preset`` become the wrappers of ``routing.py``, which hold the policies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .allocators import Allocator, allocator_class, allocator_from_dict, allocator_names
from .base import Policy
from .full import FullPolicy
from .h2o import H2OPolicy
from .presets import PRESETS
from .pyramidkv import PyramidKVPolicy
from .random_policy import RandomPolicy
from .routing import AnyPolicy, ByBudget, ByPromptKind
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
"""The product's policies (a process may register more: :func:`register_policy`, :func:`policy_names`)."""
DEFAULT_POLICY = "vlcache"
DEFAULT_TEXT_PRESET: dict[str, str] = {"vlcache": "vlcache_text_by_budget"}
"""The preset that compresses a policy's text-only prompts when a request names the policy (``get_policy``;
protocol v2.2 and held-out seed 5, ``docs/compression.md``); a policy not listed compresses them itself."""
ROUTE_KEYS = ("text_preset", "low_budget_preset", "low_budget_below")
WRAPPER_NAMES = ("by_prompt_kind", "by_budget")
"""The wrappers' names in a dict (``routing.py``): ``get_policy`` and ``policy_from_dict`` read them too."""

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


def policy_names() -> tuple[str, ...]:
    """Every policy name known in this process: ``POLICY_NAMES`` (the product's) and those registered
    (:func:`register_policy`)."""
    return tuple(_POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name`` (empty = vlcache); ValueError for an unknown one."""
    cls = _POLICIES.get(name or DEFAULT_POLICY)
    if cls is None:
        raise ValueError(f"unknown compression policy {name!r}; choose from {', '.join(policy_names())}")
    return cls


def register_policy(cls: type[Policy], *, text_preset: str = "") -> None:
    """Add policy class ``cls`` under its ``name`` (a user's own policy, or the lab's), in this process only;
    ``text_preset``: the preset its text-only prompts get when a request names it (``DEFAULT_TEXT_PRESET``;
    "" none). ValueError for a name taken by another class, a wrapper's name, or a class that is not a
    ``Policy``."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or cls.name in ("", Policy.name):
        raise ValueError(f"register_policy: expected a Policy subclass with a name of its own, got {cls!r}")
    if cls.name in WRAPPER_NAMES or _POLICIES.get(cls.name, cls) is not cls:
        raise ValueError(f"compression policy {cls.name!r} exists already")
    if text_preset and text_preset not in PRESETS:
        raise ValueError(f"register_policy: unknown text preset {text_preset!r}")
    _POLICIES[cls.name] = cls
    if text_preset:
        DEFAULT_TEXT_PRESET[cls.name] = text_preset


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
    name: str = DEFAULT_POLICY,
    *,
    allocator: str | dict | Allocator | None = None,
    text_preset: str | None = None,
    low_budget_preset: str = "",
    low_budget_below: float = 0.0,
    **params: Any,
) -> AnyPolicy:
    """The policy a request naming ``name`` (empty = vlcache) gets, with dataclass ``params``.

    allocator: a registered name, an ``Allocator`` or its dict (see :func:`resolve_allocator`); None or ""
    keeps the policy's own. The flat allocator keywords (``pyramid_beta=2.0``, ``exact_budget=True``:
    ``FLAT_ALLOCATOR_PARAMS``) set that allocator's field. Routes (:func:`with_routes`): ``text_preset`` None
    is the policy's own (``DEFAULT_TEXT_PRESET``), "" none. A wrapper's name (``WRAPPER_NAMES``) takes its
    parts as its dict holds them (``get_policy(d.pop("policy"), **d)`` for any ``to_dict()``). Unknown names
    or parameters raise ValueError.
    """
    if name in WRAPPER_NAMES:
        routes = {"text_preset": text_preset, "low_budget_preset": low_budget_preset or None}
        if allocator is not None or low_budget_below or any(v is not None for v in routes.values()):
            raise ValueError(f"policy {name!r} takes its parts only, not an allocator or routes")
        return policy_from_dict({"policy": name, **params})
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
        policy = cls(allocator=chosen, **params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from err
    if text_preset is None:
        text_preset = DEFAULT_TEXT_PRESET.get(cls.name, "")
    return with_routes(policy, text_preset, low_budget_preset, low_budget_below)


def with_routes(
    policy: Policy, text_preset: str = "", low_budget_preset: str = "", low_budget_below: float = 0.0
) -> AnyPolicy:
    """``policy`` handing budgets below ``low_budget_below`` to preset ``low_budget_preset`` (a
    :class:`ByBudget`) and text-only prompts to preset ``text_preset`` (a :class:`ByPromptKind`); "" for either:
    no such route. ValueError for an unknown preset, a text preset that routes text prompts itself, a
    low-budget preset that is a wrapper or reads other statistics rows."""
    for key, value in (("text_preset", text_preset), ("low_budget_preset", low_budget_preset)):
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a str (a preset's name), got {value!r}")
    if isinstance(low_budget_below, bool) or not isinstance(low_budget_below, int | float):
        raise ValueError(f"low_budget_below must be a float, got {low_budget_below!r}")
    if bool(low_budget_preset) != (0.0 < low_budget_below < 1.0):
        raise ValueError(
            "low_budget_preset and low_budget_below in (0, 1) go together, got "
            f"{low_budget_preset!r} below {low_budget_below}"
        )
    routed: Policy | ByBudget = policy
    if low_budget_preset:
        low = preset(low_budget_preset)
        if not isinstance(low, Policy):
            raise ValueError(f"low_budget_preset {low_budget_preset!r} hands prompts on itself")
        routed = ByBudget(high=policy, low=low, below=low_budget_below)
    if not text_preset:
        return routed
    text = preset(text_preset)
    if isinstance(text, ByPromptKind):
        raise ValueError(f"text_preset {text_preset!r} sets a text_preset of its own")
    return ByPromptKind(image=routed, text=text)


def policy_from_dict(data: Any) -> AnyPolicy:
    """A policy from its dict: ``{"policy": name, "allocator": {...}, <option>: value}`` (``Policy.to_dict``'s
    shape; only ``policy`` is required), with optional routes by preset name (``text_preset``,
    ``low_budget_preset`` and ``low_budget_below``: :func:`with_routes`; a dict without ``text_preset`` gets
    the policy's default route, as a request naming it does, and ``text_preset`` "" none), or a wrapper's
    (``{"policy": "by_prompt_kind", "image": {...}, "text": {...}}``, ``{"policy": "by_budget", "high": {...},
    "low": {...}, "below": b}``). ValueError names an unknown policy, allocator or option, a value of the
    wrong type or out of range."""
    if not isinstance(data, dict) or not isinstance(data.get("policy"), str):
        raise ValueError(f"policy: expected an object with a 'policy' name, got {data!r}")
    kind = data["policy"]
    if kind in WRAPPER_NAMES:
        parts = ("image", "text") if kind == "by_prompt_kind" else ("high", "low", "below")
        if set(data) != {"policy", *parts}:
            raise ValueError(f"policy {kind!r}: expected the keys {', '.join(parts)}, got {sorted(data)}")
        if kind == "by_prompt_kind":
            return ByPromptKind(image=policy_from_dict(data["image"]), text=policy_from_dict(data["text"]))
        below = data["below"]
        if isinstance(below, bool) or not isinstance(below, int | float):
            raise ValueError(f"policy 'by_budget': below must be a number, got {below!r}")
        return ByBudget(high=policy_from_dict(data["high"]), low=policy_from_dict(data["low"]), below=below)
    cls = policy_class(kind)
    rest = {k: v for k, v in data.items() if k not in ("policy", "allocator", *ROUTE_KEYS)}
    params = fields_from_dict(cls, rest, f"policy {cls.name!r}", skip=("allocator",))
    policy = cls(allocator=resolve_allocator(cls, data.get("allocator")), **params)
    return with_routes(policy, **_routes(data, cls))


def _routes(data: dict[str, Any], cls: type[Policy]) -> dict[str, Any]:
    """A plain policy's dict's route keys, ``text_preset`` the policy's default route when absent."""
    routes = {k: data[k] for k in ROUTE_KEYS if k in data}
    routes.setdefault("text_preset", DEFAULT_TEXT_PRESET.get(cls.name, ""))
    return routes


def preset(name: str) -> AnyPolicy:
    """The policy of preset ``name`` (``presets.PRESETS``); ValueError for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown compression preset {name!r}; choose from {', '.join(PRESETS)}")
    return policy_from_dict(PRESETS[name])


def preset_params(name: str) -> dict[str, Any]:
    """``get_policy(policy, **params)`` keywords for preset ``name``: every field of its policy, the allocator
    as a dict, the routes as the preset names them (``text_preset`` "" when it names none). ValueError for an
    unknown preset or one written as a wrapper's dict (build that with :func:`preset`)."""
    preset(name)  # ValueError for an unknown or invalid one
    data = PRESETS[name]
    if data["policy"] in WRAPPER_NAMES:
        raise ValueError(f"preset {name!r} is a wrapper's dict; build it with preset()")
    plain = policy_from_dict({k: v for k, v in data.items() if k not in ROUTE_KEYS} | {"text_preset": ""})
    params = plain.to_dict()
    params.pop("policy")
    return params | _routes(data, type(plain))


def register_preset(name: str, settings: dict[str, Any]) -> None:
    """Add preset ``name`` (:func:`policy_from_dict`'s shape); ValueError for a taken name or settings no
    policy accepts. Registered in a process, it is known there only (a route may name it)."""
    if name in PRESETS:
        if PRESETS[name] == settings:
            return  # registered again by a re-imported module: the same preset
        raise ValueError(f"compression preset {name!r} exists already")
    policy_from_dict(settings)
    PRESETS[name] = dict(settings)


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
        if self.policy not in _POLICIES:
            names = ", ".join(policy_names())
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

    def build_policy(self) -> AnyPolicy:
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
