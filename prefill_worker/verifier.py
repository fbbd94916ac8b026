"""Verified compression: a request's compressed cache checked against its own full cache before the hand-off.

After the prompt's forward the prefill worker decodes a greedy draft of ``d`` tokens over the full cache
(``draft_queries.run_draft``, each step's log-softmax kept); the draft is a probe, never sent to the client. Each
candidate of the server's set compresses the prompt at the budget, and the draft is teacher-forced through
every distinct compressed cache in one forward (``teacher_force.agreement``: the decode step's own attention
over the compact K/V). Agreement is the share of draft positions whose greedy token under the compressed
cache is the full cache's, KL the mean ``KL(p_full || p_compressed)``. The best (agreement, then KL, then the
earlier candidate) is kept; in ``floor`` mode, while its agreement is below the floor the budget doubles (up to
the cap) and the candidates are verified again. :class:`Verdict` says what happened; ``Usage`` carries it.

With a learned order (``ledger.Ledger``: enough requests at this budget) the most-winning candidate is
verified alone first and kept when it meets the floor; only when it does not are the others verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from vlkv.common.compression.base import Policy
from vlkv.common.compression.verify import VerifyPlan
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.prefill_worker.draft_queries import Draft
from vlkv.prefill_worker.teacher_force import agreement


@dataclass(frozen=True)
class Candidate:
    label: str
    policy: Policy


@dataclass
class Verdict:
    """mode: select or floor; candidate: the kept one's label; agreement / kl: its scores; raises: budget
    doublings; floor_met: agreement >= floor; budget: what the kept cache was compressed at; draft_tokens: the
    positions scored (0: the first token ended the answer, nothing to check); verified: candidate caches
    teacher-forced, all rounds together."""

    mode: str
    candidate: str
    agreement: float
    kl: float
    raises: int
    floor_met: bool
    budget: float
    draft_tokens: int
    verified: int


Compress = Callable[[Policy, float], CompactKV]


def distinct_caches(caches: Sequence[CompactKV]) -> tuple[list[CompactKV], list[int]]:
    """The caches that keep different positions, and per input its index among them (decoded once)."""
    out, slot, seen = [], [], {}
    for cache in caches:
        kept = tuple(idx.cpu().numpy().tobytes() for idx in cache.kept_indices or [])
        key = kept if cache.kept_indices is not None else id(cache)
        if key not in seen:
            seen[key] = len(out)
            out.append(cache)
        slot.append(seen[key])
    return out, slot


def _score(model, caches: list[CompactKV], draft: Draft) -> list[tuple[float, float]]:
    if not draft.inputs or draft.logprobs is None:
        return [(1.0, 0.0)] * len(caches)
    unique, slot = distinct_caches(caches)
    scores = agreement(model, unique, draft.inputs, draft.tokens, draft.logprobs)
    return [scores[s] for s in slot]


def _best(
    scored: list[tuple[int, CompactKV, tuple[float, float]]],
) -> tuple[int, CompactKV, tuple[float, float]]:
    """Highest agreement, then lowest KL, then the earlier candidate."""
    return min(scored, key=lambda x: (-x[2][0], x[2][1], x[0]))


@torch.inference_mode()
def verify(
    model,
    candidates: Sequence[Candidate],
    plan: VerifyPlan,
    budget: float,
    compress: Compress,
    draft: Draft,
    learned: bool = False,
) -> tuple[CompactKV, Verdict]:
    """The kept cache and the verdict. ``compress(policy, budget)`` compresses this prompt (its statistics and
    draft rows already bound); ``draft``: the full cache's greedy draft with its log-probabilities; ``learned``:
    ``candidates`` are in the order of their wins (verify the first alone, the rest only when it falls short)."""
    if not candidates:
        raise ValueError("verification needs at least one candidate")
    b, raises, verified = budget, 0, 0
    while True:
        if learned and plan.mode == "floor" and len(candidates) > 1:  # the others compressed only if needed
            head = [compress(candidates[0].policy, b)]
            first = _score(model, head, draft)
            verified += 1
            if first[0][0] >= plan.floor:
                scored = [(0, head[0], first[0])]
            else:
                caches = head + [compress(c.policy, b) for c in candidates[1:]]
                rest = _score(model, caches[1:], draft)
                verified += len(rest)
                scored = list(zip(range(len(caches)), caches, first + rest, strict=True))
        else:
            caches = [compress(c.policy, b) for c in candidates]
            scores = _score(model, caches, draft)
            verified += len(scores)
            scored = list(zip(range(len(caches)), caches, scores, strict=True))
        index, cache, (agree, kl) = _best(scored)
        if plan.mode != "floor" or agree >= plan.floor or b >= plan.cap:
            break
        b = min(2.0 * b, plan.cap)
        raises += 1
    verdict = Verdict(
        mode=plan.mode,
        candidate=candidates[index].label,
        agreement=agree,
        kl=kl,
        raises=raises,
        floor_met=agree >= plan.floor,
        budget=b,
        draft_tokens=len(draft.inputs),
        verified=verified,
    )
    return cache, verdict


CONTINUED = "continue"
"""The verdict's candidate when a ``continue`` turn's continued cache was kept."""


@torch.inference_mode()
def check_continued(
    model, cache: CompactKV, plan: VerifyPlan, budget: float, draft: Draft
) -> tuple[bool, Verdict]:
    """Whether a continued cache (the previous turn's compact cache with the new tokens appended) reproduces
    the full cache's draft at ``plan.floor`` (select mode too: it is kept only where it holds), and its verdict."""
    ((agree, kl),) = _score(model, [cache], draft)
    verdict = Verdict(
        mode=plan.mode,
        candidate=CONTINUED,
        agreement=agree,
        kl=kl,
        raises=0,
        floor_met=agree >= plan.floor,
        budget=budget,
        draft_tokens=len(draft.inputs),
        verified=1,
    )
    return verdict.floor_met, verdict


def verdict_fields(verdict: Verdict | None) -> dict:
    """The verdict as ``PrefillReply``'s (and ``Usage``'s) fields of the same names; {} when not verified."""
    if verdict is None:
        return {}
    return {
        "verify": verdict.mode,
        "verified_candidate": verdict.candidate,
        "verified_agreement": verdict.agreement,
        "verified_kl": verdict.kl,
        "budget_raises": verdict.raises,
        "floor_met": verdict.floor_met,
        "verified_budget": verdict.budget,
        "draft_tokens": verdict.draft_tokens,
    }
