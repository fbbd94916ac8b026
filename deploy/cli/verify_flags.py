"""``vlkv serve``'s verified-compression flags (``common/compression/verify.py``): defined once, read into a
:class:`VerifyConfig` (a bad value is refused at start-up, naming the flag); ``vlkv status``'s line of a
prefill worker's outcomes."""

from __future__ import annotations

import argparse

from vlkv.common.compression.verify import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_FLOOR,
    DEFAULT_LEARN_AFTER,
    DEFAULT_MAX_BUDGET,
    DEFAULT_VERIFY,
    VERIFY_MODES,
    VerifyConfig,
)


def add_verify_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify",
        default=DEFAULT_VERIFY,
        choices=VERIFY_MODES,
        help="verified compression for requests that name no policy: each candidate's cache is checked "
        "against the full cache's greedy draft before the hand-off; select keeps the best at the budget, "
        "floor also doubles the budget until --fidelity-floor holds (up to --max-budget); off: the policy "
        f"as configured (default {DEFAULT_VERIFY})",
    )
    p.add_argument(
        "--fidelity-floor",
        type=float,
        default=DEFAULT_FLOOR,
        help=f"draft agreement --verify floor asks for, in [0, 1] (default {DEFAULT_FLOOR})",
    )
    p.add_argument(
        "--max-budget",
        type=float,
        default=DEFAULT_MAX_BUDGET,
        help=f"the largest budget --verify floor raises to, in (0, 1] (default {DEFAULT_MAX_BUDGET})",
    )
    p.add_argument(
        "--verify-draft",
        type=int,
        default=DEFAULT_DRAFT_TOKENS,
        help=f"greedy draft tokens each verification scores (default {DEFAULT_DRAFT_TOKENS})",
    )
    p.add_argument(
        "--verify-learn-after",
        type=int,
        default=DEFAULT_LEARN_AFTER,
        help="verified requests per budget after which the candidates are tried in the order of their wins, "
        f"the first alone when it meets the floor (0: never; default {DEFAULT_LEARN_AFTER})",
    )
    p.add_argument(
        "--learned-profile",
        default="",
        metavar="PATH",
        help="where each prefill worker writes its verifier outcomes as a compression profile (every "
        "--verify-learn-after requests); loaded at start-up when it exists (another model's is refused)",
    )
    add_prefill_concurrency_flag(p)


def add_prefill_concurrency_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill-concurrency",
        type=int,
        default=1,
        help="requests each prefill worker runs at once; their greedy drafts (verification, lookahead) step "
        "as one batch, which amortizes the weight reads of a draft step on a GPU (default 1)",
    )


def verify_config(args) -> VerifyConfig:
    """ValueError naming the flag for a bad value."""
    return VerifyConfig(
        mode=getattr(args, "verify", DEFAULT_VERIFY),
        floor=getattr(args, "fidelity_floor", DEFAULT_FLOOR),
        max_budget=getattr(args, "max_budget", DEFAULT_MAX_BUDGET),
        draft_tokens=getattr(args, "verify_draft", DEFAULT_DRAFT_TOKENS),
        learn_after=getattr(args, "verify_learn_after", DEFAULT_LEARN_AFTER),
    )


def format_verifier(v) -> str:
    """One prefill worker's ``VerifierStats``: requests, raises, floor misses, wins, agreement per budget."""
    wins = ", ".join(f"{k} {n}" for k, n in sorted(v.wins.items(), key=lambda x: -x[1]))
    per = ", ".join(
        f"{b}%: {v.mean_agreement[b]:.3f} (n={v.bucket_requests[b]})"
        for b in sorted(v.mean_agreement, key=float)
    )
    text = (
        f"{v.verified} verified, {v.budget_raises} budget raises, {v.floor_misses} floor misses; "
        f"wins: {wins}; mean agreement {per}"
    )
    return text + (f"; learned profile {v.learned_profile}" if v.learned_profile else "")
