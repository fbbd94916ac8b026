"""``Policy.span_skip`` / ``span_skip_weight``: the prompt's first positions spread only a share of their
score forward (``span_after``; 0: nothing), whatever their attention; they still score, and are kept, for
their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from policy_stats import column_stats
from vlkv.common.compression import get_policy, policy_from_dict

M, K = 300, 24  # recent window 3 (297..299), 21 scored slots


def _stats(col_sum: torch.Tensor) -> SimpleNamespace:
    return column_stats(col_sum, 8)


def _scores() -> torch.Tensor:
    """A sink-like pair at the start of the user turn (20, 21) that outscores everything, the name the
    question looks up at 200 and its unattended value at 201..212."""
    scores = torch.full((1, M), 0.01)
    scores[0, 20:22] = 5.0
    scores[0, 200] = 3.0
    scores[0, 201:213] = 0.0
    return scores


def _kept(scores: torch.Tensor | None = None, **params) -> list[int]:
    policy = get_policy("snapkv", pool_kernel=1, span_after=12, **params)
    keys = torch.zeros(1, M, 4)
    scores = _scores() if scores is None else scores
    return policy.select(policy.score(0, _stats(scores), keys, keys, M, 0), K, 0)[0].tolist()


def test_span_skip_keeps_the_value_the_sink_block_spread_crowds_out():
    plain, skip = _kept(), _kept(span_skip=32)
    # without the skip the pair's spans (20..33) outrank the name's (200..212): 14 slots, 7 left for the value
    assert set(range(20, 34)) <= set(plain)
    assert sum(v in plain for v in range(200, 213)) == 7
    # with it the pair is kept for its own score, spreads nothing, and the name's whole span fits
    assert {20, 21} <= set(skip) and not set(range(22, 34)) & set(skip)
    assert set(range(200, 213)) <= set(skip)
    assert len(skip) == K == len(set(skip))


def test_span_skip_weight_spreads_a_share_so_a_fact_inside_the_skipped_positions_keeps_its_value():
    # damped to half, the pair's spans (2.5) rank below the name's (3.0): the value first, the pair's
    # spans in the slots left over
    half = _kept(span_skip=32, span_skip_weight=0.5)
    assert set(range(200, 213)) <= set(half) and {20, 21} <= set(half)
    assert set(half) - set(range(200, 213)) - {20, 21} == set(range(22, 28)) | {297, 298, 299}
    # a fact at the start of the context (name at 24, value 25..36): skipped outright it loses its value,
    # spread at half it keeps it
    early = torch.full((1, M), 0.01)
    early[0, 24] = 3.0
    early[0, 25:37] = 0.0
    assert not set(range(25, 37)) & set(_kept(early, span_skip=32))
    assert set(range(24, 37)) <= set(_kept(early, span_skip=32, span_skip_weight=0.5))


def test_span_skip_within_the_sinks_changes_nothing():
    scores = torch.rand(3, M, generator=torch.Generator().manual_seed(2))
    keys = torch.zeros(3, M, 4)
    base = get_policy("vlcache", span_after=16, sink_tokens=4, pool_kernel=1)
    for skip in (0, 2, 4):
        policy = get_policy("vlcache", span_after=16, sink_tokens=4, pool_kernel=1, span_skip=skip)
        got = policy.score(0, _stats(scores), keys, keys, M, M)
        assert torch.equal(got, base.score(0, _stats(scores), keys, keys, M, M))
    assert base.span_skip == 0  # off unless set


def test_span_skip_round_trips_and_rejects_negative_values():
    policy = get_policy("vlcache", span_after=12, span_skip=32)
    data = policy.to_dict()
    assert data["image"]["span_skip"] == 32 and policy_from_dict(data) == policy
    with pytest.raises(ValueError, match="span_skip"):
        get_policy("vlcache", span_skip=-1)
    with pytest.raises(ValueError, match="span_skip_weight"):
        get_policy("vlcache", span_skip=8, span_skip_weight=1.5)
