"""``DraftMass(floor_layers=n)``: the first n layers keep at least their pyramid budget, the rest is spent by
the draft's attention as before; 0 is the plain allocator, the total and ``[1, m]`` are kept, bad values are
refused, and the field survives a policy's and a profile's round trip."""

from __future__ import annotations

import json

import pytest
import torch
from policy_stats import L, M, draft_stats
from vlkv.common.compression import DraftMass, Pyramid, get_policy, policy_from_dict
from vlkv.common.compression.allocators import allocator_from_dict
from vlkv.common.compression.budgets import raise_to_floors
from vlkv.common.compression.lookahead import draft_mass_budgets
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, read_profile

ALPHAS = [0.01, 0.05, 0.1, 0.37, 0.9]


@pytest.mark.parametrize("weight", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_floor_zero_is_todays_allocator(weight, alpha):
    stats = draft_stats(seed=1, peaked=(0,))
    assert DraftMass(weight=weight, floor_layers=0).budgets(stats, alpha, M, L) == DraftMass(
        weight=weight
    ).budgets(stats, alpha, M, L)
    gains = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02], [0.25] * 4], dtype=torch.float64)
    assert draft_mass_budgets(gains, 6, floors=[1, 1, 1]) == draft_mass_budgets(gains, 6) == [2, 1, 3]


@pytest.mark.parametrize("n", [1, 2, L - 1])
@pytest.mark.parametrize("weight", [0.5, 1.0])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_the_first_layers_keep_the_pyramid_and_the_total_is_kept(n, weight, alpha):
    stats = draft_stats(seed=2, peaked=(0, 1))  # the draft alone starves layers 0 and 1
    pyramid = Pyramid(beta=4.0).budgets(stats, alpha, M, L)
    budgets = DraftMass(weight=weight, floor_layers=n).budgets(stats, alpha, M, L)
    assert sum(budgets) == sum(pyramid) and all(1 <= k <= M for k in budgets)
    assert all(budgets[i] >= pyramid[i] for i in range(n))


def test_the_floor_binds_where_the_draft_takes_the_first_layer_away():
    stats = draft_stats(seed=2, peaked=(0,))
    alpha = 0.3
    pyramid = Pyramid(beta=4.0).budgets(stats, alpha, M, L)
    plain = DraftMass(weight=1.0).budgets(stats, alpha, M, L)
    floored = DraftMass(weight=1.0, floor_layers=1).budgets(stats, alpha, M, L)
    assert plain[0] < pyramid[0] and floored[0] == pyramid[0]
    # the later layers still follow the draft: what the floor took comes off them, none gains
    assert all(f <= p for f, p in zip(floored[1:], plain[1:], strict=True)) and floored != pyramid


def test_a_floor_over_every_layer_is_the_pyramid():
    stats = draft_stats(seed=3)
    for alpha in ALPHAS:
        pyramid = Pyramid(beta=4.0).budgets(stats, alpha, M, L)
        assert DraftMass(weight=1.0, floor_layers=L + 5).budgets(stats, alpha, M, L) == pyramid
        assert DraftMass(weight=0.5, floor_layers=L).budgets(stats, alpha, M, L) == pyramid


def test_floored_greedy_spends_the_rest_by_the_gains():
    gains = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02], [0.25] * 4], dtype=torch.float64)
    # layer 1 starts at 3 slots; the 2 further slots go to the best gains past each floor: 0.3, 0.25
    assert draft_mass_budgets(gains, 7, floors=[1, 3, 1]) == [2, 3, 2]
    assert draft_mass_budgets(gains, 2, floors=[1, 3, 1]) == [1, 3, 1]  # the floors beat a smaller total
    assert draft_mass_budgets(gains, 99, floors=[9, 1, 1]) == [4, 4, 4]


def test_raise_to_floors_keeps_the_sum():
    assert raise_to_floors([2, 9, 5], [6, 1, 1]) == [6, 5, 5]
    assert raise_to_floors([3, 3], [1, 1]) == [3, 3]
    with pytest.raises(ValueError):
        raise_to_floors([1, 1], [2, 1])


def test_bad_values_are_refused_and_the_field_round_trips():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError):
            DraftMass(floor_layers=bad)
    with pytest.raises(ValueError):
        allocator_from_dict({"name": "draft_mass", "floor_layers": 0.5})
    with pytest.raises(ValueError):
        allocator_from_dict({"name": "draft_mass", "floor_layers": -2})
    allocator = DraftMass(weight=0.5, floor_layers=2)
    assert allocator.to_dict() == {"name": "draft_mass", "weight": 0.5, "beta": 4.0, "floor_layers": 2}
    assert allocator_from_dict(json.loads(json.dumps(allocator.to_dict()))) == allocator
    assert "floor_layers" not in DraftMass().to_dict()  # files written before the field read the same
    policy = get_policy("vlcache", allocator={"name": "draft_mass", "weight": 0.5, "floor_layers": 1})
    again = policy_from_dict(json.loads(json.dumps(policy.to_dict())))
    assert again == policy and again.allocator == DraftMass(weight=0.5, floor_layers=1)


def test_a_profile_carries_the_floor(tmp_path):
    policy = get_policy("vlcache", allocator=DraftMass(weight=0.5, floor_layers=2), post_vision_window=False)
    profile = CompressionProfile(
        model={"fingerprint": "abc"},
        prompts={"digest": "0" * 64, "count": 1},
        measure={"tokens": 8},
        entries=[ProfileEntry(budget=0.05, candidate="draft floor", policy=policy)],
    )
    profile.write(tmp_path / "compression_profile.json")
    again = read_profile(tmp_path / "compression_profile.json").policy_for(0.05)
    assert again == policy and again.allocator.floor_layers == 2
