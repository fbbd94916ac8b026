"""Layer budget allocators: Algorithm 1 on hand-computed sparsities, exact totals, pyramid, CAKE."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from vlkv.common.compression import budgets as budgets_mod
from vlkv.common.compression import (
    cake_budgets,
    cake_preferences,
    fit_total,
    layer_sparsity,
    pyramid_budgets,
    realized_ratio,
    sparsity_budgets,
    uniform_budgets,
)

# L = 3, m = 100, alpha = 0.2, gamma = [0.5, 0.8, 0.9]:
#   1 - gamma = [0.5, 0.2, 0.1], Z = 0.8
#   beta = [0.5/0.8*0.6, 0.2/0.8*0.6, 0.1/0.8*0.6] = [0.375, 0.15, 0.075]  (no clipping)
#   k = ceil(beta * 100) = [38, 15, 8]
# Exact: target round(0.2*3*100) = 60; shares [37.5, 15, 7.5] -> floors [37, 15, 7] (59), +1 to the
#   first of the two .5 remainders -> [38, 15, 7].
# Upper clip: gamma = [0, 0.9, 0.99], alpha = 0.5: 1 - gamma = [1, 0.1, 0.01], Z = 1.11,
#   beta = [1.3514 -> 1, 0.13514, 0.013514] -> k = [100, 14, 2] (116 of the 150 asked);
#   exact: layer 0 capped at 100, the other 50 split 10:1 -> [45.45, 4.545] -> [45, 5].
# Lower clip: m = 1000, gamma = [0, 0.999, 0.999], alpha = 0.1: Z = 1.002,
#   beta = [0.2994, 0.000299 -> 0.01, 0.000299 -> 0.01] -> k = [300, 10, 10] (320 of 300);
#   exact: floor ceil(0.01*1000) = 10 holds layers 1-2, layer 0 takes the rest -> [280, 10, 10].
HAND_CASES = [
    ([0.5, 0.8, 0.9], 0.2, 100, [38, 15, 8], [38, 15, 7]),
    ([0.0, 0.9, 0.99], 0.5, 100, [100, 14, 2], [100, 45, 5]),
    ([0.0, 0.999, 0.999], 0.1, 1000, [300, 10, 10], [280, 10, 10]),
]


@pytest.mark.parametrize(("gammas", "alpha", "m", "expected", "expected_exact"), HAND_CASES)
def test_algorithm1_hand_computed(gammas, alpha, m, expected, expected_exact):
    assert sparsity_budgets(gammas, alpha, m) == expected
    assert sparsity_budgets(torch.tensor(gammas), alpha, m) == expected
    assert sparsity_budgets(gammas, alpha, m, exact=True) == expected_exact


def test_algorithm1_matches_formula_on_random_sparsities():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_layers = int(torch.randint(1, 9, (1,), generator=gen))
        m = int(torch.randint(1, 400, (1,), generator=gen))
        gammas = torch.rand(num_layers, generator=gen).double().tolist()
        alpha = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        z = sum(1 - g for g in gammas)
        want = [min(m, max(1, math.ceil(round(min(max((1 - g) / z * alpha * num_layers, 0.01), 1) * m, 9))))
                for g in gammas]  # fmt: skip
        assert sparsity_budgets(gammas, alpha, m) == want


@pytest.mark.parametrize("m", [1, 2, 7, 100, 1234])
@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.1, 0.37, 0.9])
def test_exact_mode_hits_target_within_bounds(m, alpha):
    gen = torch.Generator().manual_seed(m)
    for num_layers in (1, 3, 8):
        gammas = torch.rand(num_layers, generator=gen).tolist()
        budgets = sparsity_budgets(gammas, alpha, m, exact=True)
        floor = max(1, math.ceil(0.01 * m))
        target = min(max(round(alpha * num_layers * m), num_layers * floor), num_layers * m)
        assert sum(budgets) == target
        assert all(floor <= k <= m for k in budgets)


def test_edge_cases():
    assert sparsity_budgets([0.0, 0.0, 0.0], 0.1, 50) == [5, 5, 5]  # Z = L -> beta = alpha
    assert sparsity_budgets([1.0, 1.0], 0.1, 50) == [5, 5]  # Z = 0 -> equal shares
    assert sparsity_budgets([1.0, 1.0], 0.1, 50, exact=True) == [5, 5]
    for exact in (False, True):
        assert sparsity_budgets([0.5, 0.9, 0.2], 1.0, 64, exact=exact) == [64, 64, 64]
        assert sparsity_budgets([0.3, 0.6], 0.5, 1, exact=exact) == [1, 1]  # tiny m
    assert uniform_budgets(4, 1.0, 9) == [9] * 4
    assert uniform_budgets(2, 0.1, 30) == [3, 3]  # 0.1 * 30 ceils to 3, not 4
    assert uniform_budgets(2, float(torch.tensor(0.1, dtype=torch.float32)), 30) == [3, 3]  # proto float
    assert sparsity_budgets([0.5, 0.5], float(torch.tensor(0.1, dtype=torch.float32)), 30) == [3, 3]
    assert uniform_budgets(2, 0.001, 30) == [1, 1]
    with pytest.raises(ValueError):
        sparsity_budgets([0.5], 0.0, 10)
    with pytest.raises(ValueError):
        sparsity_budgets([1.5], 0.1, 10)


def test_pyramid_decreasing_same_total():
    for num_layers, alpha, m in [(4, 0.1, 100), (6, 0.3, 57), (32, 0.05, 2000), (5, 0.6, 100)]:
        budgets = pyramid_budgets(num_layers, alpha, m)
        assert sum(budgets) == sum(uniform_budgets(num_layers, alpha, m))
        assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False))
        assert all(1 <= k <= m for k in budgets)
        assert budgets[0] > budgets[-1]
    assert pyramid_budgets(3, 1.0, 10) == [10, 10, 10]
    assert pyramid_budgets(1, 0.25, 8) == [2]


def test_fit_total_proportional_without_clipping():
    assert fit_total([3.0, 1.0], 40, 1, 100) == [30, 10]
    assert fit_total([0.0, 0.0, 0.0], 9, 1, 100) == [3, 3, 3]
    assert fit_total([1.0, 0.0], 150, 1, 100) == [100, 50]  # zero weight absorbs what the cap leaves


def _stats_from_probs(probs: torch.Tensor) -> SimpleNamespace:
    """probs: [H, Tq, m] masked softmax rows (masked entries 0)."""
    return SimpleNamespace(
        row_max=torch.zeros(probs.shape[:2]),
        row_sumexp=torch.ones(probs.shape[:2]),
        col_sum=probs.sum(1),
        col_sqsum=(probs**2).sum(1),
        below=torch.zeros(probs.shape[0]),
        unmasked=torch.ones(probs.shape[0]),
    )


def test_cake_preferences_definition():
    # One head, Tq = 2 rows at positions 2..3 of m = 4; considered columns j < 2.
    probs = torch.tensor([[[0.6, 0.2, 0.2, 0.0], [0.1, 0.3, 0.2, 0.4]]])
    stats = _stats_from_probs(probs)
    mean = torch.tensor([0.35, 0.25])
    dist = mean / mean.sum()
    entropy = float(-(dist * dist.log()).sum())
    variance = float(((probs[0, :, :2] - mean) ** 2).mean(0).sum())  # population variance, summed
    (pref,) = cake_preferences([stats], tau1=1.0, tau2=1.0)
    assert pref == pytest.approx(entropy * variance, rel=1e-6)
    (pref2,) = cake_preferences([stats], tau1=2.0, tau2=4.0)
    assert pref2 == pytest.approx(entropy**0.5 * variance**0.25, rel=1e-6)
    del stats.col_sqsum  # without the second moment: entropy only
    assert cake_preferences([stats]) == [pytest.approx(entropy, rel=1e-6)]


def test_cake_budgets_proportional_with_exact_total():
    budgets = cake_budgets([2.0, 1.0, 1.0], 0.2, 100)  # total 3 * ceil(0.2 * 100) = 60, split 2:1:1
    assert budgets == [30, 15, 15]
    assert sum(cake_budgets([5.0, 0.1, 0.1], 0.5, 100)) == 150
    assert cake_budgets([0.0, 0.0], 0.1, 20) == [2, 2]
    assert cake_budgets([1.0, 2.0], 1.0, 7) == [7, 7]


def test_layer_sparsity_is_head_mean():
    stats = SimpleNamespace(below=torch.tensor([3, 1]), unmasked=torch.tensor([4, 4]))
    assert layer_sparsity(stats) == pytest.approx((0.75 + 0.25) / 2)
    assert realized_ratio([10, 20], 100) == pytest.approx(0.15)


def test_pyramid_budgets_are_fitted_once_per_arguments(monkeypatch):
    """Kept per (L, alpha, m, beta) (``vlkv calibrate`` asks for the same ones per candidate and budget): the
    fitted budgets, a list of the caller's own, fitted again for other arguments."""
    calls = []
    real = budgets_mod.fit_total
    monkeypatch.setattr(budgets_mod, "fit_total", lambda *a: calls.append(a) or real(*a))
    budgets_mod._pyramid.cache_clear()
    first = pyramid_budgets(30, 0.05, 761, beta=4.0)
    top, bottom = 2.0 - 1.0 / 4.0, 1.0 / 4.0
    weights = [top - (top - bottom) * i / 29 for i in range(30)]
    assert first == real(weights, sum(budgets_mod.uniform_budgets(30, 0.05, 761)), 1, 761)
    first.append(-1)  # the caller's list: the kept result is not changed
    again = pyramid_budgets(30, 0.05, 761, beta=4.0)
    assert again == first[:-1] and len(calls) == 1
    pyramid_budgets(30, 0.05, 762, beta=4.0)
    assert len(calls) == 2  # another m: fitted anew
    with pytest.raises(ValueError):
        pyramid_budgets(30, 0.05, 761, beta=0.5)
