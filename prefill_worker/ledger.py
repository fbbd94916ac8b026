"""The verifier's outcomes on one prefill worker, counted per requested budget, and the profile they teach.

``Ledger.record`` counts each verified request: the candidate kept, its agreement, the budget raises and
whether the floor was met. Once a budget bucket has ``learn_after`` requests, ``order`` returns the
candidates by their wins there (ties in the server's order) and says the order is learned, so the verifier
tries the most-winning one alone first (``verifier.verify``). ``profile`` writes the outcomes in ``vlkv
calibrate``'s format (``common/compression/profile.py``: versioned, fingerprinted; ``measure.kind`` is
``"verifier"``, each table row's ``prompts`` the candidate's wins): a restart that loads it (``vlkv serve
--learned-profile``) starts with the same order, and another model's profile is refused there.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from vlkv.common.compression.profile import CompressionProfile, ProfileEntry
from vlkv.common.compression.verify import budget_bucket
from vlkv.prefill_worker.verifier import Candidate, Verdict

LEARNED_KIND = "verifier"


@dataclass
class _Bucket:
    """One requested budget's outcomes: per candidate its wins and the summed agreement and KL of the caches
    it was kept for."""

    budget: float
    wins: Counter = field(default_factory=Counter)
    agreed: dict = field(default_factory=lambda: defaultdict(float))
    kl: dict = field(default_factory=lambda: defaultdict(float))

    @property
    def requests(self) -> int:
        return sum(self.wins.values())

    @property
    def agreement(self) -> float:
        """Summed over every request of the bucket."""
        return sum(self.agreed.values())


class Ledger:
    def __init__(
        self, candidates: list[Candidate], learn_after: int, fingerprint: str, model_info=None
    ) -> None:
        self.candidates = list(candidates)
        self.learn_after = learn_after
        self.fingerprint = fingerprint
        self.model_info = dict(model_info or {})
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self.verified = 0
        self.raises = 0
        self.floor_misses = 0
        self.learned_profile = ""
        self._policies = {c.label: c.policy for c in self.candidates}

    def _bucket(self, budget: float) -> _Bucket:
        key = budget_bucket(budget)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(budget)
        return self._buckets[key]

    def order(self, budget: float) -> tuple[list[Candidate], bool]:
        """The candidates to verify at requested ``budget`` and whether the order is learned."""
        with self._lock:
            bucket = self._buckets.get(budget_bucket(budget))
            if bucket is None or not self.learn_after or bucket.requests < self.learn_after:
                return list(self.candidates), False
            rank = {c.label: i for i, c in enumerate(self.candidates)}
            ordered = sorted(self.candidates, key=lambda c: (-bucket.wins[c.label], rank[c.label]))
            return ordered, True

    def record(self, requested: float, verdict: Verdict, policy=None) -> None:
        """Count one verified request; ``policy``: the kept candidate's (one outside the set, a calibrated
        profile's entry, is remembered for ``profile``)."""
        with self._lock:
            if policy is not None:
                self._policies.setdefault(verdict.candidate, policy)
            bucket = self._bucket(requested)
            bucket.wins[verdict.candidate] += 1
            bucket.kl[verdict.candidate] += verdict.kl
            bucket.agreed[verdict.candidate] += verdict.agreement
            self.verified += 1
            self.raises += verdict.raises
            self.floor_misses += 0 if verdict.floor_met else 1

    def seed(self, profile: CompressionProfile) -> int:
        """Start from a learned profile's counts (``profile``'s table rows); returns the rows taken."""
        if profile.measure.get("kind") != LEARNED_KIND:
            return 0
        labels = {c.label for c in self.candidates}
        taken = 0
        with self._lock:
            for row in profile.table:
                if row["candidate"] not in labels:
                    continue
                bucket = self._bucket(float(row["budget"]))
                wins = int(row.get("prompts", 0))
                bucket.wins[row["candidate"]] += wins
                bucket.kl[row["candidate"]] += float(row["kl"]) * wins
                bucket.agreed[row["candidate"]] += float(row["agreement"]) * wins
                taken += 1
        return taken

    def snapshot(self) -> dict:
        """What ``WorkerLoad.verifier`` reports."""
        with self._lock:
            wins: Counter = Counter()
            for b in self._buckets.values():
                wins.update(b.wins)
            return {
                "verified": self.verified,
                "budget_raises": self.raises,
                "floor_misses": self.floor_misses,
                "wins": dict(wins),
                "mean_agreement": {
                    k: b.agreement / b.requests for k, b in self._buckets.items() if b.requests
                },
                "bucket_requests": {k: b.requests for k, b in self._buckets.items()},
                "learned_profile": self.learned_profile,
            }

    def profile(self) -> CompressionProfile | None:
        """The outcomes as a compression profile (None before any request was verified): per budget bucket the
                most-winning candidate's policy, and a table row per candidate that won there (its wins as ``prompts``,
        the mean agreement and KL of the caches it was kept for)."""
        policies = self._policies
        rank = {c.label: i for i, c in enumerate(self.candidates)}
        with self._lock:
            entries, table = [], []
            for b in sorted(self._buckets.values(), key=lambda x: x.budget):
                if not b.requests:
                    continue
                top = min(b.wins, key=lambda label: (-b.wins[label], rank.get(label, len(rank))))
                entries.append(ProfileEntry(b.budget, top, policies[top]))
                for label, n in sorted(b.wins.items(), key=lambda x: rank.get(x[0], len(rank))):
                    table.append(
                        {
                            "candidate": label,
                            "budget": b.budget,
                            "agreement": b.agreed[label] / n,
                            "kl": b.kl[label] / n,
                            "prompts": n,
                            "policy": policies[label].to_dict(),
                        }
                    )
            if not entries:
                return None
            total = sum(b.requests for b in self._buckets.values())
        return CompressionProfile(
            model={"fingerprint": self.fingerprint, **self.model_info},
            prompts={"digest": "", "count": total, "source": "served requests"},
            measure={"kind": LEARNED_KIND},
            entries=entries,
            table=table,
        )

    def write(self, path: str | Path) -> str:
        """Write the learned profile (``CompressionProfile.write``: atomically); returns its label."""
        profile = self.profile()
        if profile is None:
            return ""
        label = profile.write(path)
        with self._lock:
            self.learned_profile = label
        return label
