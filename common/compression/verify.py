"""Verified compression's settings: the modes, the server's defaults and the candidate set.

A request's verification (``CompressionParams.verify``, ``fidelity_floor``, ``max_budget``) is resolved against
the server's :class:`VerifyConfig` (``vlkv serve --verify ...``) by :meth:`VerifyConfig.plan`:

- ``off``: the request's (or the profile's) policy compresses at its budget, as before verification existed.
- ``select``: every candidate compresses at exactly the requested budget; the prefill worker teacher-forces its
  own greedy draft over the full cache through each compressed cache and keeps the one that agrees best
  (``prefill_worker/verifier.py``). The realized budget is the requested one.
- ``floor``: ``select``, then while the kept candidate's agreement is below ``fidelity_floor`` the budget doubles
  (up to ``max_budget``) and the candidates are verified again. A floor out of reach is served at the cap and
  says so (``floor_met`` false); it is never an error.

A request that names no policy (``explicit`` False) gets the server's mode; one that names its own policy
keeps it (``off``) unless it sets ``verify`` itself. The floor and the cap come from the request when it sets
them, else from the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .presets import PRESETS
from .verify_checks import VERIFY_MODES, check_cap, check_floor, check_mode

__all__ = ["VERIFY_MODES", "VerifyConfig", "VerifyPlan", "budget_bucket"]
DEFAULT_VERIFY = "floor"
DEFAULT_FLOOR = 0.9
"""Agreement the ``floor`` mode asks of the kept cache: 15 of a 16-token draft reproduced (a user's
requirement, stated in tokens, not a value fitted to a model)."""
DEFAULT_MAX_BUDGET = 0.25
"""The largest budget ``floor`` raises to: a quarter of the cache still holds 4x the sequences of a full one."""
DEFAULT_DRAFT_TOKENS = 16
DEFAULT_LEARN_AFTER = 64
"""Requests per budget bucket after which the verifier tries the candidates in the order of their wins and
stops at the first that meets the floor (``Ledger``)."""

# (label, policy dict): the candidates a verified request chooses between, in the order a tie goes: today's
# unverified default first, then VL-Cache with uniform layer budgets, SnapKV and the paper's VL-Cache (the
# rows that won some budget on the two outside checkpoints of issue #62 and on the zoo's calibrations).
VERIFY_CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", PRESETS["vlcache_default"]),
    ("uniform", {"policy": "vlcache", "allocator": {"name": "uniform"}}),
    ("snapkv", {"policy": "snapkv"}),
    ("paper", PRESETS["vlcache_paper"]),
)


@dataclass(frozen=True)
class VerifyPlan:
    """What one request's prefill verifies: ``mode`` select or floor, the floor, the cap (never below the
    requested budget) and the draft's length."""

    mode: str
    floor: float
    cap: float
    draft_tokens: int


@dataclass(frozen=True)
class VerifyConfig:
    """The server's verification defaults (``vlkv serve --verify --fidelity-floor --max-budget
    --verify-draft --verify-learn-after``) and candidate set."""

    mode: str = DEFAULT_VERIFY
    floor: float = DEFAULT_FLOOR
    max_budget: float = DEFAULT_MAX_BUDGET
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    learn_after: int = DEFAULT_LEARN_AFTER
    candidates: tuple[tuple[str, dict[str, Any]], ...] = field(default=VERIFY_CANDIDATES)

    def __post_init__(self) -> None:
        check_mode(self.mode, "--verify")
        check_floor(self.floor, "--fidelity-floor")
        check_cap(self.max_budget, "--max-budget")
        if not 1 <= self.draft_tokens <= 256:
            raise ValueError(f"--verify-draft must be in [1, 256], got {self.draft_tokens}")
        if self.learn_after < 0:
            raise ValueError(f"--verify-learn-after must be >= 0, got {self.learn_after}")
        labels = [label for label, _ in self.candidates]
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"verification candidates need distinct labels, got {labels}")

    def plan(self, settings) -> VerifyPlan | None:
        """The verification of a request with these ``CompressionSettings`` (None: not verified: mode off, a
        full cache, or a named policy that did not ask)."""
        mode = settings.verify if settings.verify is not None else ("off" if settings.explicit else self.mode)
        if mode == "off" or settings.is_full:
            return None
        floor = settings.fidelity_floor if settings.fidelity_floor is not None else self.floor
        cap = settings.max_budget if settings.max_budget is not None else self.max_budget
        return VerifyPlan(mode, floor, max(cap, settings.budget), self.draft_tokens)


def budget_bucket(budget: float) -> str:
    """The label a budget is counted under (metrics and the learned order): the budget in percent, two
    significant digits ("2", "5", "10", "0.5")."""
    return f"{budget * 100:.2g}"
