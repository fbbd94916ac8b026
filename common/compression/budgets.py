"""Layer budget allocators: how many of the m prompt tokens each of the L layers keeps.

Every allocator returns ``list[int]`` of length L with ``1 <= k_l <= m``. A budget ``alpha >= 1`` always
means "no compression" (every layer keeps m), whatever the allocator.

- ``sparsity_budgets``: VL-Cache Algorithm 1 (paper 001, section 4.1), optionally with an exact total.
- ``uniform_budgets``: ``ceil(alpha * m)`` in every layer (H2O, StreamingLLM, SnapKV).
- ``pyramid_budgets``: PyramidKV, linearly decreasing with depth, same total as uniform.
- ``cake_budgets`` / ``cake_preferences``: CAKE (paper 004), proportional to an entropy/variance preference.
- ``mixed_budgets``: EffiVLM-Bench's finding on VL-Cache: ``1 - w`` of the total split uniformly and ``w``
  by Algorithm 1's shares, so no layer is starved at low budgets.
- ``coverage_budgets`` / ``coverage_counts``: proportional to how many tokens each layer needs to cover a
  fixed share of its attention mass (a strong, skewed layer needs few; a diffuse one many; AirCache's idea
  of sizing layers by the strength and skew of their score distribution), with a floor per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from .stats import AttentionStatsLike, num_query_rows

_EPS = 1e-6  # relative float noise guard: 0.1 * 30 (or float32 0.1 from a proto) ceils to 3, not 4


def _ceil(x: float) -> int:
    """ceil that ignores relative noise below 1e-6 (alpha often arrives as a float32)."""
    return math.ceil(x - _EPS * max(1.0, abs(x)))


def _check(alpha: float, m: int, num_layers: int) -> None:
    if not alpha > 0:
        raise ValueError(f"budget alpha must be in (0, 1], got {alpha}")
    if m < 1 or num_layers < 1:
        raise ValueError(f"need m >= 1 and L >= 1, got m={m}, L={num_layers}")


def fit_total(weights: Sequence[float], total: int, lo: int, hi: int) -> list[int]:
    """Integer budgets proportional to ``weights`` under bounds, with an exact sum.

    Finds the scale c with ``sum_l clip(c * w_l, lo, hi) == total`` (bisection; the sum is monotone in c),
    then rounds by largest remainder, so the result lies in ``[lo, hi]`` and sums to ``total`` (clamped to
    ``[L*lo, L*hi]``). Zero weights get a vanishing share so they still absorb budget once every other
    layer is full; all-zero weights mean equal shares. With no clipping, ``b_l = w_l / sum(w) * total``.
    """
    n = len(weights)
    total = min(max(total, n * lo), n * hi)
    w = torch.tensor([max(float(x), 0.0) for x in weights], dtype=torch.float64)
    if float(w.max()) <= 0.0:
        w = torch.ones(n, dtype=torch.float64)
    w = w.clamp_min(float(w.max()) * 1e-12)
    lo_c, hi_c = 0.0, hi / float(w.min())
    for _ in range(200):
        mid = (lo_c + hi_c) / 2
        if float((mid * w).clamp(lo, hi).sum()) < total:
            lo_c = mid
        else:
            hi_c = mid
    cont = (hi_c * w).clamp(lo, hi)
    base = [min(max(math.floor(float(x) + _EPS), lo), hi) for x in cont]
    frac = [float(x) - b for x, b in zip(cont, base, strict=True)]
    diff = total - sum(base)
    while diff != 0:  # terminates: total is reachable within [lo, hi]
        step = 1 if diff > 0 else -1
        order = sorted(range(n), key=lambda i: -frac[i] if step > 0 else frac[i])
        for i in order:
            if diff == 0:
                break
            if (step > 0 and base[i] < hi) or (step < 0 and base[i] > lo):
                base[i] += step
                frac[i] -= step
                diff -= step
    return base


def raise_to_floors(budgets: Sequence[int], floors: Sequence[int]) -> list[int]:
    """``budgets`` with every layer below its floor raised to it, the tokens taken one at a time from the
    layer furthest above its own floor (ties: the later layer), so the sum is kept. ValueError when the
    floors sum to more than the budgets."""
    out = [int(b) for b in budgets]
    need = [int(f) for f in floors]
    if len(need) != len(out) or sum(need) > sum(out):
        raise ValueError(f"floors {need} cannot be met within budgets {out}")
    for i in range(len(out)):
        while out[i] < need[i]:
            j = max(range(len(out)), key=lambda k: (out[k] - need[k], k))
            out[j] -= 1
            out[i] += 1
    return out


def sparsity_budgets(
    layer_sparsity: Sequence[float] | torch.Tensor, alpha: float, m: int, *, exact: bool = False
) -> list[int]:
    """VL-Cache Algorithm 1: budgets from the layer sparsities gamma_l (post-vision ThresholdFilter).

    ``Z = sum_l (1 - gamma_l)``; ``beta_l = clip((1 - gamma_l) / Z * alpha * L, 0.01, 1)``;
    ``k_l = ceil(beta_l * m)`` clamped to ``[1, m]``. Clipping moves the realized ratio off alpha.

    exact: instead hit ``round(alpha * L * m)`` tokens in total: the same proportional shares, bounded to
    ``[max(1, ceil(0.01 m)), m]``, with what clipping removed or added redistributed over the unclipped
    layers, then rounded by largest remainder (see :func:`fit_total`).
    Edge cases: ``alpha >= 1`` gives m everywhere; all gamma_l = 1 (Z = 0) shares alpha equally.
    """
    gammas = [
        float(g) for g in (layer_sparsity.tolist() if torch.is_tensor(layer_sparsity) else layer_sparsity)
    ]
    n = len(gammas)
    _check(alpha, m, n)
    if any(not 0.0 <= g <= 1.0 for g in gammas):
        raise ValueError(f"layer sparsities must lie in [0, 1], got {gammas}")
    if alpha >= 1:
        return [m] * n
    dense = [1.0 - g for g in gammas]
    z = sum(dense)
    if z <= 0:
        dense, z = [1.0] * n, float(n)
    if exact:
        floor = max(1, _ceil(0.01 * m))
        return fit_total(dense, round(alpha * n * m), floor, m)
    betas = [min(max(d / z * alpha * n, 0.01), 1.0) for d in dense]
    return [min(max(_ceil(b * m), 1), m) for b in betas]


def uniform_budgets(num_layers: int, alpha: float, m: int) -> list[int]:
    """``ceil(alpha * m)`` tokens in every layer, clamped to ``[1, m]``."""
    _check(alpha, m, num_layers)
    return [min(max(_ceil(alpha * m), 1), m)] * num_layers


def pyramid_budgets(num_layers: int, alpha: float, m: int, *, beta: float = 20.0) -> list[int]:
    """PyramidKV: an arithmetic sequence decreasing with depth, same total as :func:`uniform_budgets`.

    Relative to the mean budget, the last layer gets ``1 / beta`` and the first ``2 - 1 / beta``; the
    shares are then fitted to the total under ``[1, m]`` (layers that would exceed m pass the surplus on,
    keeping the order) with :func:`fit_total`. A function of its four numbers alone, kept for the last 1024
    (:func:`_pyramid`): ``vlkv calibrate`` asks for the same ones per candidate, budget and prompt.
    """
    _check(alpha, m, num_layers)
    if beta < 1:
        raise ValueError(f"pyramid beta must be >= 1, got {beta}")
    return list(_pyramid(num_layers, alpha, m, beta))


@lru_cache(maxsize=1024, typed=True)
def _pyramid(num_layers: int, alpha: float, m: int, beta: float) -> tuple[int, ...]:
    total = sum(uniform_budgets(num_layers, alpha, m))
    if num_layers == 1 or total >= num_layers * m:
        return (min(total // num_layers, m),) * num_layers
    top, bottom = 2.0 - 1.0 / beta, 1.0 / beta
    weights = [top - (top - bottom) * i / (num_layers - 1) for i in range(num_layers)]
    return tuple(fit_total(weights, total, 1, m))


def cake_preferences(
    stats_per_layer: Sequence[AttentionStatsLike], *, tau1: float = 1.0, tau2: float = 1.0
) -> list[float]:
    """CAKE layer preference ``P_l = H_l ** (1/tau1) * V_l ** (1/tau2)`` from each layer's statistics.

    With Tq query rows (absolute positions ``q_start = m - Tq .. m-1``), the columns considered are the
    keys before the window, ``j < q_start`` (all m keys when ``q_start == 0``), as CAKE excludes the
    window's own, partly masked keys.

    - Spatial dispersion H_l: per query head h, the window-mean attention ``a_hj = col_sum_hj / Tq`` is
      renormalized over the considered columns and its Shannon entropy (nats) taken; H_l is the mean over
      heads. (The kernel gives no per-row entropy; the entropy of the mean row upper-bounds the mean row
      entropy and also grows when the focus shifts between rows.)
    - Temporal shift V_l: per head, the population variance over the Tq rows of each column,
      ``col_sqsum_hj / Tq - a_hj ** 2`` (masked entries count as 0), summed over the considered columns;
      V_l is the mean over heads. This needs the optional ``col_sqsum`` statistic; without it V_l = 1
      and the preference is entropy-only.
    """
    prefs = []
    for stats in stats_per_layer:
        tq = num_query_rows(stats)
        m = stats.col_sum.shape[-1]
        cols = slice(0, m - tq) if m - tq > 0 else slice(0, m)
        mean = stats.col_sum.to(torch.float64)[:, cols] / tq
        dist = mean / mean.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        entropy = -(dist * dist.clamp_min(1e-30).log()).sum(dim=-1).mean()
        sqsum = getattr(stats, "col_sqsum", None)
        if sqsum is None:
            variance = torch.tensor(1.0, dtype=torch.float64)
        else:
            var = (sqsum.to(torch.float64)[:, cols] / tq - mean**2).clamp_min(0.0)
            variance = var.sum(dim=-1).mean()
        prefs.append(float(entropy.clamp_min(0) ** (1 / tau1) * variance ** (1 / tau2)))
    return prefs


def cake_budgets(preferences: Sequence[float], alpha: float, m: int) -> list[int]:
    """CAKE allocation ``B_l = P_l / sum_k P_k * B_total``, with B_total the uniform total, fitted to
    ``[1, m]`` with an exact sum (:func:`fit_total`). All-zero preferences give equal shares."""
    num_layers = len(preferences)
    total = sum(uniform_budgets(num_layers, alpha, m))
    if total >= num_layers * m:
        return [m] * num_layers
    return fit_total(preferences, total, 1, m)


def realized_ratio(budgets: Sequence[int], m: int) -> float:
    """``sum_l k_l / (L * m)``, the fraction of the full cache actually kept."""
    return sum(budgets) / (len(budgets) * m)


def mixed_budgets(layer_sparsity: Sequence[float], alpha: float, m: int, *, weight: float = 0.2) -> list[int]:
    """``b_l = (1 - w) * T / L + w * T * (1 - gamma_l) / sum_k (1 - gamma_k)`` with T the uniform total,
    fitted to ``[1, m]`` with an exact sum (:func:`fit_total`). ``w = 0`` is uniform, ``w = 1`` Algorithm 1's
    proportions at the uniform total."""
    n = len(layer_sparsity)
    _check(alpha, m, n)
    total = sum(uniform_budgets(n, alpha, m))
    if total >= n * m:
        return [m] * n
    dense = [max(0.0, 1.0 - float(g)) for g in layer_sparsity]
    z = sum(dense)
    shares = [d / z for d in dense] if z > 0 else [1.0 / n] * n
    weights = [(1.0 - weight) / n + weight * sh for sh in shares]
    return fit_total(weights, total, 1, m)


def coverage_counts(stats_per_layer: Sequence[AttentionStatsLike], mass: float = 0.9) -> list[float]:
    """Per layer: the mean over query heads of the fewest keys whose window attention (``col_sum`` over the
    keys before the statistics rows, normalised per head) reaches ``mass`` of the total."""
    counts = []
    for stats in stats_per_layer:
        tq = num_query_rows(stats)
        m = stats.col_sum.shape[-1]
        cols = slice(0, m - tq) if m - tq > 0 else slice(0, m)
        col = stats.col_sum.to(torch.float64)[:, cols]
        dist = col / col.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        cum = dist.sort(dim=-1, descending=True).values.cumsum(dim=-1)
        need = (cum < mass - 1e-12).sum(dim=-1) + 1  # keys until the cumulative mass reaches `mass`
        counts.append(float(need.clamp_max(cum.shape[-1]).double().mean()))
    return counts


def coverage_budgets(
    counts: Sequence[float], alpha: float, m: int, *, floor_share: float = 0.25
) -> list[int]:
    """Budgets proportional to ``counts`` (:func:`coverage_counts`) at the uniform total, every layer
    keeping at least ``floor_share`` of the uniform budget."""
    n = len(counts)
    _check(alpha, m, n)
    uniform = uniform_budgets(n, alpha, m)
    total = sum(uniform)
    if total >= n * m:
        return [m] * n
    lo = max(1, min(m, math.floor(floor_share * uniform[0])))
    return fit_total(counts, total, lo, m)
