"""A compression profile: the settings ``vlkv calibrate`` chose for one checkpoint, per budget.

``compression_profile.json`` (schema version 1) holds the model's fingerprint (``ModelSpec.fingerprint``,
the one a KV hand-off is checked against: weights, dtype and KV layout), the calibration prompts' digest,
the chosen policy per budget (``Policy.to_dict``'s shape) and the agreement table it was chosen from.
:func:`read_profile` validates the whole file (ValueError naming what is wrong: bad JSON, another format or
version, a missing or unknown key, an unknown policy option); :meth:`CompressionProfile.check_model`
refuses another model's profile.

At serving time a request that names no policy, allocator or exact budget (``CompressionSettings.explicit``
False) runs the entry whose budget is nearest its own (:meth:`CompressionProfile.policy_for`); the request's
own budget is what the policy keeps.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import Policy
from .registry import policy_from_dict
from .serialize import check_keys

PROFILE_FORMAT = "vlkv.compression_profile"
PROFILE_VERSION = 1
PROFILE_FILENAME = "compression_profile.json"
_TOP_KEYS = ("format", "version", "model", "prompts", "measure", "entries", "table")
# exact, prompts, recall, same_as: optional
_ROW_KEYS = ("candidate", "budget", "agreement", "kl", "exact", "recall", "prompts", "policy", "same_as")


@dataclass
class ProfileEntry:
    """One budget's choice: ``candidate`` is the label it had in the calibration grid."""

    budget: float
    candidate: str
    policy: Policy

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "candidate": self.candidate, "policy": self.policy.to_dict()}


@dataclass
class CompressionProfile:
    """model: ``{"fingerprint": ..., ...}`` (path, dtype: informative); prompts: ``{"digest": sha256,
    "count": n, ...}``; measure: how agreement was measured (``{"tokens": N}``); entries: the choice per
    budget, ascending; table: one row per candidate and budget (``_ROW_KEYS``; ``exact``: the share of prompts
    whose whole answer the candidate reproduced, absent in profiles written before it was measured; ``recall``:
    the free-running answer recall, ``vlkv calibrate --rerank``'s rows only; ``same_as``: the earlier candidate
    that kept the same positions on every prompt, absent when none did or the profile predates it)."""

    model: dict[str, Any]
    prompts: dict[str, Any]
    measure: dict[str, Any]
    entries: list[ProfileEntry]
    table: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # "<file name>:<sha256 of its bytes, 12 hex>", set by read_profile / write

    @property
    def fingerprint(self) -> str:
        return str(self.model["fingerprint"])

    @property
    def budgets(self) -> list[float]:
        return [e.budget for e in self.entries]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": self.model,
            "prompts": self.prompts,
            "measure": self.measure,
            "entries": [e.to_dict() for e in self.entries],
            "table": self.table,
        }

    def entry_for(self, budget: float) -> ProfileEntry:
        """The entry whose budget is nearest ``budget`` on a log scale (1% is as far from 2% as 5% from
        10%); a tie goes to the smaller budget."""
        return min(self.entries, key=lambda e: (abs(math.log(e.budget) - math.log(budget)), e.budget))

    def policy_for(self, budget: float) -> Policy:
        return self.entry_for(budget).policy

    def check_model(self, fingerprint: str) -> None:
        """ValueError unless the profile was calibrated on the model with this fingerprint."""
        if self.fingerprint != fingerprint:
            raise ValueError(
                f"compression profile {self.label or '(unsaved)'} was calibrated on another model "
                f"(fingerprint {self.fingerprint}, path {self.model.get('path', '?')}, dtype "
                f"{self.model.get('dtype', '?')}); this model's fingerprint is {fingerprint}. Run "
                "`vlkv calibrate` on this checkpoint (and dtype), or serve without the profile"
            )

    def write(self, path: str | Path) -> str:
        """Write the profile as JSON, atomically (a server starting meanwhile never reads half a file: the
        verifier rewrites its learned profile while serving); returns (and sets) its label."""
        path = Path(path)
        data = (json.dumps(self.to_dict(), indent=1) + "\n").encode()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        self.label = _label(path.name, data)
        return self.label


def _label(name: str, data: bytes) -> str:
    return f"{name}:{hashlib.sha256(data).hexdigest()[:12]}"


def _number(value: Any, what: str, low: float = -math.inf, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what}: expected a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what}: {value} is outside [{low}, {high}]")
    return float(value)


def profile_from_dict(data: Any, label: str = "") -> CompressionProfile:
    """A validated profile from its JSON dict (see the module docstring); ValueError says what is wrong."""
    check_keys(data, _TOP_KEYS, "compression profile")
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(
            f"compression profile: format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}"
        )
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"compression profile: version {data.get('version')!r} is not supported (this vlkv reads "
            f"version {PROFILE_VERSION}; re-run `vlkv calibrate`)"
        )
    for key in ("model", "prompts", "measure"):
        if not isinstance(data.get(key), dict):
            raise ValueError(f"compression profile: {key!r} must be an object")
    if not isinstance(data["model"].get("fingerprint"), str) or not data["model"]["fingerprint"]:
        raise ValueError("compression profile: model.fingerprint must be a non-empty string")
    if not isinstance(data["prompts"].get("digest"), str):
        raise ValueError("compression profile: prompts.digest must be a string")
    raw = data.get("entries")
    if not isinstance(raw, list) or not raw:
        raise ValueError("compression profile: 'entries' must be a non-empty list")
    entries = []
    for i, entry in enumerate(raw):
        what = f"compression profile: entries[{i}]"
        check_keys(entry, ("budget", "candidate", "policy"), what)
        budget = _number(entry.get("budget"), f"{what}.budget", 1e-6, 1.0)
        try:
            policy = policy_from_dict(entry.get("policy"))
        except ValueError as err:
            raise ValueError(f"{what}.policy: {err}") from None
        entries.append(ProfileEntry(budget, str(entry.get("candidate", "")), policy))
    if len({e.budget for e in entries}) != len(entries):
        raise ValueError("compression profile: two entries share a budget")
    table = data.get("table", [])
    if not isinstance(table, list):
        raise ValueError("compression profile: 'table' must be a list")
    for i, row in enumerate(table):
        check_keys(row, _ROW_KEYS, f"compression profile: table[{i}]")
        for key in ("budget", "agreement", "kl"):
            _number(row.get(key), f"compression profile: table[{i}].{key}")
        if "exact" in row:  # absent in a profile written before it was measured
            _number(row["exact"], f"compression profile: table[{i}].exact", 0.0, 1.0)
        if "recall" in row:  # only the rows --rerank decoded free-running
            _number(row["recall"], f"compression profile: table[{i}].recall", 0.0, 1.0)
        if "same_as" in row and not isinstance(row["same_as"], str):
            raise ValueError(f"compression profile: table[{i}].same_as must be a candidate's label")
    entries.sort(key=lambda e: e.budget)
    return CompressionProfile(data["model"], data["prompts"], data["measure"], entries, table, label)


def read_profile(path: str | Path) -> CompressionProfile:
    """Read and validate ``path``; ValueError names the file and what is wrong with it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read compression profile {path}: {err.strerror or err}") from None
    try:
        return profile_from_dict(json.loads(data), _label(path.name, data))
    except json.JSONDecodeError as err:
        raise ValueError(f"compression profile {path} is not valid JSON: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def find_profile(model_dir: str | Path, explicit: str = "") -> Path | None:
    """The profile a server loads: ``explicit`` ("none": no profile), else ``compression_profile.json``
    beside the checkpoint when it exists."""
    if explicit == "none":
        return None
    if explicit:
        return Path(explicit)
    beside = Path(model_dir) / PROFILE_FILENAME
    return beside if beside.is_file() else None
