"""The ``draft_mass`` allocator: layer budgets by the lookahead draft's attention mass blended with a pyramid;
an exact total within ``[1, m]``, deterministic, the pyramid itself without draft rows, and it round-trips."""

from __future__ import annotations

import json

import pytest
import torch
from policy_stats import TAU, L, M, draft_stats, draft_sums, make_inputs, stats_for
from vlkv.common.compression import DraftMass, Pyramid, get_policy, policy_from_dict
from vlkv.common.compression.allocators import allocator_from_dict
from vlkv.common.compression.budgets import pyramid_budgets, uniform_budgets
from vlkv.common.compression.lookahead import draft_gains, draft_mass_budgets, with_draft
from vlkv.common.compression.registry import CompressionSettings


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.1, 0.37, 0.9])
def test_budgets_sum_to_the_pyramids_total_within_bounds(weight, alpha):
    stats = draft_stats(seed=1)
    budgets = DraftMass(weight=weight).budgets(stats, alpha, M, L)
    assert len(budgets) == L and all(1 <= k <= M for k in budgets)
    assert sum(budgets) == sum(uniform_budgets(L, alpha, M)) == sum(pyramid_budgets(L, alpha, M, beta=4.0))


def test_a_peaked_layer_gets_less_than_diffuse_ones_and_the_blend_lies_between():
    stats = draft_stats(
        seed=2, peaked=(0,)
    )  # layer 0: the draft attends to 2 keys; the pyramid favours it most
    alpha = 0.3
    pyramid = Pyramid(beta=4.0).budgets(stats, alpha, M, L)
    own = DraftMass(weight=1.0).budgets(stats, alpha, M, L)
    half = DraftMass(weight=0.5).budgets(stats, alpha, M, L)
    assert own[0] < min(own[1:]) and pyramid[0] > max(pyramid[1:])
    assert own[0] < half[0] < pyramid[0]
    assert own[0] >= 2  # both keys that hold the peaked layer's mass are covered


def test_draft_mass_budgets_cover_the_most_mass_greedily():
    gains = torch.tensor(
        [[0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64
    )
    # after one slot each, the best 3 further gains: 0.3 (layer 0), 0.25 and 0.25 (layer 2); a tie at 0.25
    # with layer 2's third slot goes to the earlier slot
    assert draft_mass_budgets(gains, 6) == [2, 1, 3]
    assert draft_mass_budgets(gains, 3) == [1, 1, 1]
    assert draft_mass_budgets(gains, 1) == [1, 1, 1]  # clamped to one per layer
    assert draft_mass_budgets(gains, 99) == [4, 4, 4]  # clamped to m per layer


def test_equal_gains_are_split_deterministically():
    gains = torch.full((5, 8), 1 / 8, dtype=torch.float64)
    first = draft_mass_budgets(gains, 17)
    assert sum(first) == 17 and all(draft_mass_budgets(gains, 17) == first for _ in range(5))


def test_deterministic_on_the_same_statistics():
    stats = draft_stats(seed=3)
    runs = [DraftMass(weight=0.7).budgets(stats, 0.2, M, L) for _ in range(4)]
    assert all(r == runs[0] for r in runs)


@pytest.mark.parametrize("alpha", [0.02, 0.1, 0.5])
def test_without_draft_rows_it_is_the_pyramid_exactly(alpha):
    qs, ks, _ = make_inputs(4, 2, seed=4)
    plain = stats_for(get_policy("vlcache"), qs, ks)
    ended = with_draft(plain, draft_sums(4, M, L, 4), 0)  # the draft ended at once (EOS first)
    assert draft_gains(plain) is None and draft_gains(ended) is None
    for stats in (plain, ended):
        assert DraftMass(weight=1.0, beta=2.0).budgets(stats, alpha, M, L) == Pyramid(beta=2.0).budgets(
            stats, alpha, M, L
        )


def test_lookahead_zero_plans_as_the_pyramid_policy():
    qs, ks, vs = make_inputs(4, 2, seed=5)
    a = get_policy("vlcache", lookahead=0, allocator="draft_mass")
    b = get_policy("vlcache", lookahead=0)
    stats = stats_for(a, qs, ks)
    plans = [p.plan(stats, ks, vs, alpha=0.2, m=M, tau=TAU) for p in (a, b)]
    assert all(torch.equal(x, y) for x, y in zip(*plans, strict=True))


def test_the_policy_keeps_the_draft_budgets_per_layer():
    qs, ks, vs = make_inputs(4, 2, seed=6)
    policy = get_policy("vlcache", allocator=DraftMass(weight=1.0))
    stats = with_draft(stats_for(policy, qs, ks), draft_sums(4, M, L, 6, peaked=(1,)), 4)
    budgets = policy.allocate(stats, 0.3, M, L)
    assert budgets != Pyramid(beta=4.0).budgets(stats, 0.3, M, L)
    kept = policy.plan(stats, ks, vs, alpha=0.3, m=M, tau=TAU)
    assert [k.shape[1] for k in kept] == budgets


def test_round_trips_and_validates():
    allocator = DraftMass(weight=0.75, beta=2.0)
    assert allocator_from_dict(json.loads(json.dumps(allocator.to_dict()))) == allocator
    assert allocator.to_dict() == {"name": "draft_mass", "weight": 0.75, "beta": 2.0}
    policy = get_policy("vlcache", allocator={"name": "draft_mass", "weight": 1.0})
    again = policy_from_dict(json.loads(json.dumps(policy.to_dict())))
    assert again == policy and again.allocator == DraftMass(weight=1.0)
    # the name of vlcache's own allocator's kind keeps its parameters (the default's floor), as "pyramid" did
    assert CompressionSettings(
        policy="vlcache", allocator="draft_mass"
    ).build_policy().allocator == DraftMass(floor_layers=2)
    assert (
        CompressionSettings(policy="snapkv", allocator="draft_mass").build_policy().allocator == DraftMass()
    )
    for bad in ({"weight": 1.5}, {"weight": -0.1}, {"beta": 0.5}):
        with pytest.raises(ValueError):
            DraftMass(**bad)
    with pytest.raises(ValueError):
        allocator_from_dict({"name": "draft_mass", "share": 0.5})


def test_the_draft_gains_are_computed_once_per_layer_object_and_equal_a_fresh_computation(monkeypatch):
    stats = draft_stats(seed=5, peaked=(2,))
    fresh = draft_stats(seed=5, peaked=(2,))  # the same statistics in new objects
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(
        torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or real_sort(self, *a, **k)
    )
    first = draft_gains(stats)
    assert len(sorts) == L  # one sort per layer
    again = draft_gains(stats)
    assert len(sorts) == L  # the same objects: nothing sorted again
    assert torch.equal(first, again) and torch.equal(first, draft_gains(fresh)) and len(sorts) == 2 * L
    budgets = DraftMass(floor_layers=2).budgets(stats, 0.2, M, L)
    assert budgets == DraftMass(floor_layers=2).budgets(draft_stats(seed=5, peaked=(2,)), 0.2, M, L)
