"""Every policy through one table: kept counts, top-k + recent window by brute force, gather, GQA."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from policy_stats import TAU, L, M, make_inputs, stats_for
from vlkv.common.compression import (
    POLICY_NAMES,
    Allocator,
    Cake,
    CompressionSettings,
    DraftMass,
    Sparsity,
    allocator_names,
    get_policy,
    layer_sparsity,
    recent_count,
    register_allocator,
    sparsity_budgets,
    unregister_allocator,
)

HEADS = [(4, 2), (4, 4)]  # (H, H_kv): GQA and MHA


def expected_scores(name: str, stats: SimpleNamespace, kv_heads: int, m: int) -> torch.Tensor | None:
    """Brute-force per-query-head scores summed over each GQA group (None: not attention-based)."""
    probs = stats.probs  # [H, Tq, m]
    heads, tq, _ = probs.shape
    half = {"vlcache": 1, "snapkv": 3, "pyramidkv": 3}.get(name, 0)  # max-pool widths 3 and 7
    if name == "h2o":
        per_head = probs.sum(1)
    elif name == "zipcache":
        per_head = probs.sum(1) / (probs > 0).sum(1).clamp_min(1)
    elif name in ("vlcache", "snapkv", "pyramidkv"):
        col = probs.sum(1)
        per_head = torch.stack([col[:, max(0, j - half) : j + half + 1].amax(-1) for j in range(m)], dim=-1)
    else:
        return None
    g = heads // kv_heads
    return torch.stack([per_head[i * g : (i + 1) * g].sum(0) for i in range(kv_heads)])


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("allocator", [None, "uniform", "sparsity", "pyramid", "cake"])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_invariants(name, allocator, heads, kv_heads):
    policy = get_policy(name, allocator=allocator)
    qs, ks, vs = make_inputs(heads, kv_heads)
    stats = stats_for(policy, qs, ks)
    alpha = 0.25
    compact = policy.compress(stats, ks, vs, alpha=alpha, m=M, tau=TAU, first_token=7)
    budgets = policy.allocate(stats, alpha, M, L)
    assert compact.layer_lengths == budgets
    assert compact.prompt_length == M and compact.first_token == 7
    if name == "full":
        assert budgets == [M] * L
    for layer in range(L):
        idx, k_l = compact.kept_indices[layer], budgets[layer]
        assert idx.shape == (kv_heads, k_l) and idx.dtype == torch.int64
        assert bool((idx[:, 1:] > idx[:, :-1]).all()), "kept indices must be sorted and unique"
        for h in range(kv_heads):
            assert torch.equal(compact.keys[layer][h], ks[layer][h, idx[h]])
            assert torch.equal(compact.values[layer][h], vs[layer][h, idx[h]])
        if k_l == M:
            continue
        recent = recent_count(k_l)
        assert recent == math.ceil(0.1 * k_l - 1e-9)
        scores = policy.score(layer, stats[layer], ks[layer], vs[layer], M, TAU)
        want = expected_scores(name, stats[layer], kv_heads, M)
        if want is not None:
            torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-6)
        share = min(TAU, policy.post_vision_share(k_l, M)) if policy.post_vision_window else 0
        own = 0
        if policy.post_vision_by_score and 0 < share < TAU:
            # vlcache: the question's `share` best-scoring tokens, then the recent window right before them
            own, recent = share, min(recent, k_l - share, M - TAU)
            for h in range(kv_heads):
                question = scores[h, M - TAU :]
                kept_q = sorted(question[idx[h, k_l - own :] - (M - TAU)].tolist(), reverse=True)
                assert kept_q == sorted(question.tolist(), reverse=True)[:own]
            window = torch.arange(M - TAU - recent, M - TAU)
            assert bool((idx[:, k_l - own - recent : k_l - own] == window).all()), "recent window"
            end = M - TAU - recent
        else:  # the post-vision tokens (up to their share) and the recent window are the last positions
            recent = min(k_l, share + recent)
            assert bool((idx[:, k_l - recent :] == torch.arange(M - recent, M)).all()), "recent window"
            end = M - recent
        sinks = min(policy.sink_tokens, k_l - recent - own, end)  # kept outright, earliest first
        assert bool((idx[:, :sinks] == torch.arange(sinks)).all()), "sinks"
        for h in range(kv_heads):  # brute force: kept older tokens carry the top scores among the older ones
            older = scores[h, sinks:end]
            kept = sorted(older[idx[h, sinks : k_l - recent - own] - sinks].tolist(), reverse=True)
            best = sorted(older.tolist(), reverse=True)[: k_l - recent - own - sinks]
            assert kept == best


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("allocator", [None, "sparsity", "pyramid", "cake"])
def test_full_budget_returns_cache_unchanged(name, allocator):
    policy = get_policy(name, allocator=allocator)
    qs, ks, vs = make_inputs(4, 2, seed=1)
    compact = policy.compress(stats_for(policy, qs, ks), ks, vs, alpha=1.0, m=M, tau=TAU)
    assert compact.layer_lengths == [M] * L
    for layer in range(L):
        assert compact.keys[layer] is ks[layer] and compact.values[layer] is vs[layer]
        assert torch.equal(compact.kept_indices[layer], torch.arange(M).repeat(2, 1))


def test_vlcache_defaults_use_post_vision_rows_and_algorithm1():
    default = get_policy("vlcache")  # chosen on the zoo (common/compression/README.md, protocol v2.1)
    assert (default.allocator, default.pool_kernel) == (DraftMass(weight=0.5, beta=4.0, floor_layers=2), 3)
    assert not default.post_vision_window and not default.post_vision_by_score and default.lookahead == 16
    policy = get_policy("vlcache", allocator="sparsity")  # Algorithm 1
    assert policy.query_start(M, TAU) == M - TAU
    qs, ks, vs = make_inputs(4, 2, seed=2)
    stats = stats_for(policy, qs, ks)
    gammas = [layer_sparsity(s) for s in stats]
    for s in stats:  # gamma'_h = zeros / unmasked entries of the post-vision rows
        visible = TAU * M - TAU * (TAU - 1) // 2
        assert int(s.unmasked[0]) == visible
    budgets = policy.allocate(stats, 0.2, M, L)
    assert budgets == sparsity_budgets(gammas, 0.2, M)
    exact = get_policy("vlcache", allocator="sparsity", exact_budget=True).allocate(stats, 0.2, M, L)
    assert sum(exact) == round(0.2 * L * M)


def test_query_rows_per_policy_and_tau0_fallback():
    expect = {"vlcache": M - TAU, "h2o": 0, "zipcache": 0, "snapkv": M - 8, "pyramidkv": M - 8}
    for name, q0 in expect.items():
        assert get_policy(name).query_start(M, TAU) == q0
    assert get_policy("vlcache").query_start(M, 0) == M - 8  # no post-vision text
    assert get_policy("vlcache").query_start(5, 0) == 0
    assert get_policy("snapkv", window=16).query_start(M, TAU) == M - 16
    assert not get_policy("streamingllm").requires_stats and not get_policy("full").requires_stats
    assert get_policy("streamingllm", allocator="sparsity").requires_stats


def test_vlcache_tau0_runs_on_fallback_window():
    policy = get_policy("vlcache")
    qs, ks, vs = make_inputs(4, 2, seed=3)
    stats = stats_for(policy, qs, ks, tau=0)
    assert stats[0].row_max.shape == (4, 8)
    compact = policy.compress(stats, ks, vs, alpha=0.1, m=M, tau=0)
    assert compact.compression_ratio < 0.5


def test_streamingllm_keeps_sinks_and_recent():
    policy = get_policy("streamingllm", sink_tokens=4)
    _, ks, vs = make_inputs(4, 2, seed=4)
    compact = policy.compress(None, ks, vs, alpha=0.3, m=M, tau=TAU)
    k_l = math.ceil(0.3 * M)
    want = torch.cat([torch.arange(4), torch.arange(M - (k_l - 4), M)])
    for idx in compact.kept_indices:
        assert torch.equal(idx, want.repeat(2, 1))
    tiny = policy.compress(None, ks, vs, alpha=0.05, m=M, tau=TAU)  # k = 2: 1 sink + 1 recent
    assert torch.equal(tiny.kept_indices[0], torch.tensor([[0, M - 1]] * 2))


def test_random_is_seeded_deterministic():
    _, ks, vs = make_inputs(4, 2, seed=5)
    run = [get_policy("random", seed=s).compress(None, ks, vs, alpha=0.2, m=M, tau=TAU) for s in (3, 3, 4)]
    for a, b in zip(run[0].kept_indices, run[1].kept_indices, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(run[0].kept_indices, run[2].kept_indices, strict=True))


def test_tiny_prompts():
    for name in POLICY_NAMES:
        policy = get_policy(name)
        for m in (1, 2, 3):
            qs, ks, vs = make_inputs(2, 1, seed=m, m=m)
            stats = stats_for(policy, qs, ks, m=m, tau=1)
            compact = policy.compress(stats, ks, vs, alpha=0.1, m=m, tau=1)
            assert all(1 <= n <= m for n in compact.layer_lengths)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown compression policy"):
        get_policy("nope")
    with pytest.raises(ValueError, match="unknown allocator"):
        get_policy("h2o", allocator="nope")
    with pytest.raises(ValueError, match="bad parameters"):
        get_policy("h2o", window=3)
    policy = get_policy("h2o")
    qs, ks, vs = make_inputs(4, 2)
    wrong_rows = stats_for(get_policy("vlcache"), qs, ks)
    with pytest.raises(ValueError, match="query rows"):
        policy.compress(wrong_rows, ks, vs, alpha=0.1, m=M, tau=TAU)
    with pytest.raises(ValueError, match="statistics"):
        policy.compress(None, ks, vs, alpha=0.1, m=M, tau=TAU)
    assert get_policy("").name == "vlcache"


@pytest.mark.parametrize("alpha", [0.001, 0.05, 0.25, 0.9, 1.0])
@pytest.mark.parametrize("allocator", allocator_names())
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_allocator_gives_l_budgets_in_range(name, allocator, alpha):
    policy = get_policy(name, allocator=allocator, exact_budget=True)
    qs, ks, _ = make_inputs(4, 2, seed=6)
    stats = stats_for(policy, qs, ks)
    assert policy.allocator.name == allocator
    direct = policy.allocator.budgets(stats, alpha, M, L)
    for budgets in (direct, policy.allocate(stats, alpha, M, L)):
        assert len(budgets) == L and all(1 <= k <= M for k in budgets)
    if alpha >= 1:
        assert direct == [M] * L


@pytest.fixture
def toy_allocator():
    @register_allocator
    class FrontLoaded(Allocator):
        """Everything to layer 0, one token elsewhere."""

        name = "toy_front"

        def budgets(self, stats, alpha, m, L):
            return [m] + [1] * (L - 1)

    yield FrontLoaded.name
    unregister_allocator(FrontLoaded.name)


def test_registering_an_allocator_is_enough(toy_allocator):
    assert toy_allocator in allocator_names()
    policy = get_policy("streamingllm", allocator=toy_allocator)
    assert not policy.requires_stats  # needs_stats defaults to False
    _, ks, vs = make_inputs(4, 2, seed=7)
    compact = policy.compress(None, ks, vs, alpha=0.1, m=M, tau=TAU)
    assert compact.layer_lengths == [M] + [1] * (L - 1)
    assert (
        CompressionSettings("h2o", 0.1, allocator=toy_allocator).build_policy().allocator.name
        == toy_allocator
    )


def test_unregistered_allocator_is_rejected(toy_allocator):
    unregister_allocator(toy_allocator)
    with pytest.raises(ValueError, match="unknown allocator"):
        get_policy("h2o", allocator=toy_allocator)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "magic"}, "unknown compression policy 'magic'; choose from vlcache, "),
        ({"budget": 0.0}, r"compression budget must be in \(0, 1\], got 0.0"),
        ({"budget": 1.5}, "budget must be"),
        ({"budget": float("nan")}, "budget must be"),
        ({"threshold": 1.0}, r"compression threshold must be in \(0, 1\), got 1.0"),
        ({"allocator": "magic"}, "unknown allocator 'magic'; choose from sparsity, uniform, pyramid, cake"),
    ],
)
def test_settings_validate_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressionSettings(**kwargs)


def test_settings_full_cache_and_admission_estimate():
    assert CompressionSettings("full", 0.1).is_full and CompressionSettings("h2o", 1.0).is_full
    assert not CompressionSettings("vlcache", 0.99).is_full
    assert CompressionSettings("full", 0.1).layer_tokens_estimate(47, 4) == [47] * 4
    assert CompressionSettings("vlcache", 0.1).layer_tokens_estimate(47, 3) == [5] * 3
    assert CompressionSettings("vlcache", 0.001).layer_tokens_estimate(47, 2) == [1, 1]
    policy = CompressionSettings("snapkv", 0.2, allocator="cake", exact_budget=True).build_policy()
    assert (policy.name, policy.allocator) == ("snapkv", Cake())  # exact_budget: Algorithm 1's alone
    exact = CompressionSettings("vlcache", 0.2, allocator="sparsity", exact_budget=True).build_policy()
    assert exact.allocator == Sparsity(exact=True)
    _, ks, vs = make_inputs(4, 2, seed=8)  # the full policy needs no statistics at any budget
    compact = get_policy("full", allocator="sparsity").compress(None, ks, vs, alpha=0.1, m=M, tau=TAU)
    assert all(a is b for a, b in zip(compact.keys, ks, strict=True))


def test_vlcache_keeps_the_post_vision_tokens_and_the_recent_window_before_them():
    # the last question tokens (the option the zoo's default replaced by the best-scoring ones:
    # tests/unit/test_compression_options.py)
    policy = get_policy("vlcache", post_vision_by_score=False, post_vision_window=True)
    plain = get_policy("snapkv")
    scores = torch.arange(100, dtype=torch.float32).flip(0)[None]  # older tokens score higher
    for k, tau, recent in ((40, 10, 14), (12, 10, 8), (40, 2, 6), (40, 100, 4), (40, 0, 4), (1, 10, 1)):
        kept = policy.select(scores, k, tau)
        # the last `recent` positions, then the best-scoring (oldest) ones
        want = torch.cat([torch.arange(k - recent), torch.arange(100 - recent, 100)])
        assert torch.equal(kept[0], want), (k, tau)
        # policies without the post-vision window keep the paper's 10% whatever tau
        r = recent_count(k)
        assert torch.equal(
            plain.select(scores, k, tau)[0], torch.cat([torch.arange(k - r), torch.arange(100 - r, 100)])
        )
