"""vlcache's registered options beyond the paper's defaults: the post-vision window's share, row-normalised
scores, and the mixed and coverage allocators (hand-computed cases and invariants)."""

from __future__ import annotations

import pytest
import torch
from policy_stats import column_stats
from vlkv.common.compression import (
    coverage_budgets,
    coverage_counts,
    get_policy,
    mixed_budgets,
    rows_seeing,
    sparsity_budgets,
    uniform_budgets,
)


def test_mixed_is_uniform_at_weight_0_and_algorithm1_shares_at_weight_1():
    gammas, alpha, m = [0.5, 0.8, 0.9], 0.2, 100
    total = sum(uniform_budgets(3, alpha, m))
    assert mixed_budgets(gammas, alpha, m, weight=0.0) == uniform_budgets(3, alpha, m)
    # weight 1: Algorithm 1's proportions 0.5 : 0.2 : 0.1 of the uniform total 60 -> 37.5, 15, 7.5
    assert mixed_budgets(gammas, alpha, m, weight=1.0) == [38, 15, 7]
    # 0.8 uniform + 0.2 adaptive: 16 + [7.5, 3, 1.5] = [23.5, 19, 17.5]
    mixed = mixed_budgets(gammas, alpha, m, weight=0.2)
    assert sum(mixed) == total and mixed[1] == 19 and sorted(mixed, reverse=True) == mixed
    # Algorithm 1 itself starves the sparse layer much more
    assert sparsity_budgets(gammas, alpha, m)[2] < mixed[2]


def test_coverage_counts_concentrated_vs_diffuse_layers():
    m, tq = 110, 10
    concentrated = torch.zeros(2, m)
    concentrated[:, 5] = 1.0  # one key holds all the window's attention to the keys before it
    diffuse = torch.ones(2, m)  # 100 keys before the rows, equal mass
    counts = coverage_counts([column_stats(concentrated, tq), column_stats(diffuse, tq)], mass=0.9)
    assert counts == [1.0, 90.0]
    budgets = coverage_budgets(counts, 0.1, m, floor_share=0.25)
    assert sum(budgets) == sum(uniform_budgets(2, 0.1, m)) == 22
    assert budgets == [2, 20]  # the floor: 25% of the uniform 11 -> 2; the diffuse layer takes the rest


def test_row_normalised_scores_divide_by_the_rows_that_see_each_key():
    m, tq = 8, 3  # rows 5, 6, 7
    assert rows_seeing(m, tq).tolist() == [3, 3, 3, 3, 3, 3, 2, 1]
    col = torch.arange(1, m + 1, dtype=torch.float32).repeat(2, 1)
    keys = torch.zeros(1, m, 4)
    plain = get_policy("vlcache", pool_kernel=1).score(0, column_stats(col, tq), keys, keys, m, tq)
    norm = get_policy("vlcache", pool_kernel=1, row_normalized=True).score(
        0, column_stats(col, tq), keys, keys, m, tq
    )
    assert torch.allclose(norm, plain / rows_seeing(m, tq))


@pytest.mark.parametrize(
    ("params", "k", "tau", "kept_tail"),
    [
        ({"post_vision_by_score": False}, 40, 30, 20 + 4),  # half of 40, then the paper's 10% before it
        ({"post_vision_cap": 0.25, "post_vision_by_score": False}, 40, 30, 10 + 4),
        ({"post_vision_slope": 5.0, "post_vision_by_score": False}, 40, 30, 10 + 4),  # share min(0.5, 0.25)
        ({"post_vision_slope": 5.0}, 8, 30, 0 + 1),  # k/m = 0.01 -> share 0.05 of 8 -> 0
        ({"post_vision_window": False}, 40, 30, 4),
    ],
)
def test_post_vision_share(params, k, tau, kept_tail):
    m = 800
    policy = get_policy("vlcache", **{"post_vision_window": True, **params})  # the window's options
    scores = torch.arange(m, dtype=torch.float32).flip(0)[None]  # older tokens score higher
    kept = policy.select(scores, k, tau)[0]
    want = torch.cat([torch.arange(k - kept_tail), torch.arange(m - kept_tail, m)])
    assert torch.equal(kept, want)


@pytest.mark.parametrize(
    "params",
    [{"post_vision_cap": 1.5}, {"post_vision_slope": -1.0}, {"adaptive_weight": 2.0}, {"coverage_mass": 0.0}],
)
def test_bad_option_values_are_clear_errors(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        get_policy("vlcache", **params)


def test_post_vision_window_by_score_keeps_the_best_question_tokens():
    m, k, tau = 100, 20, 30  # share 10 of the 30 post-vision tokens, recent window 2 before them
    scores = torch.zeros(1, m)
    scores[0, :70] = torch.arange(70, dtype=torch.float32).flip(0)  # older image tokens score higher
    key_words = [72, 75, 81, 88, 90, 91, 93, 95, 97, 99]
    scores[0, key_words] = 1000.0
    on = {"post_vision_window": True}  # the window's option (today's default keeps no window)
    kept = get_policy("vlcache", post_vision_by_score=True, **on).select(scores, k, tau)[0].tolist()
    assert kept == list(range(8)) + [68, 69] + key_words
    # a question within its share is kept whole, as without the option
    plain, by_score = get_policy("vlcache", **on), get_policy("vlcache", post_vision_by_score=True, **on)
    assert torch.equal(plain.select(scores, 40, 15), by_score.select(scores, 40, 15))


def test_sink_tokens_are_kept_before_scored_ones():
    m, k = 100, 10
    scores = torch.arange(m, dtype=torch.float32)[None]  # newer tokens score higher
    kept = get_policy("snapkv", sink_tokens=3).select(scores, k, 0)[0].tolist()
    assert kept == [0, 1, 2] + list(range(93, 100))  # 3 sinks, then the best 6 (incl. the recent 1)
    with pytest.raises(ValueError, match="sink_tokens"):
        get_policy("vlcache", sink_tokens=-1)


def test_span_after_keeps_the_tokens_after_an_attended_one():
    m, k = 200, 20  # recent window 2 (positions 198, 199), 18 scored slots
    scores = torch.rand(1, m, generator=torch.Generator().manual_seed(0)) * 0.1
    scores[0, 50] = 5.0  # the name the question looks up; its value follows at 51..58, unattended
    scores[0, 51:59] = 0.0
    scores[0, 120:126] = 1.0  # a weaker run
    keys = torch.zeros(1, m, 4)

    def kept(**params):
        policy = get_policy("snapkv", pool_kernel=1, **params)
        return policy.select(policy.score(0, column_stats(scores, 8), keys, keys, m, 0), k, 0)[0].tolist()

    plain, spread = kept(), kept(span_after=8)
    assert 50 in plain and not set(range(51, 59)) & set(plain)
    assert len(spread) == k == len(set(spread)) and spread == sorted(spread)
    assert set(range(50, 59)) <= set(spread)  # the name and the 8 tokens after it, before the weaker run
    assert set(range(120, 129)) <= set(spread)  # the run, then its own span fills the rest (nearest first)
    with pytest.raises(ValueError, match="span_after"):
        get_policy("vlcache", span_after=-1)


def test_span_option_round_trips():
    from vlkv.common.compression import policy_from_dict

    policy = get_policy("vlcache", span_after=6)
    data = policy.to_dict()
    assert data["image"]["span_after"] == 6 and policy_from_dict(data) == policy
    with pytest.raises(ValueError, match="span_after"):
        policy_from_dict({"policy": "vlcache", "span_after": 2.0})


def test_layer_share_keeps_in_every_layer_what_one_layer_looks_up():
    m, k, layers = 60, 8, 3
    col = [torch.rand(2, m, generator=torch.Generator().manual_seed(i)) * 0.1 for i in range(layers)]
    col[2][:, 20] = 50.0  # only the last layer's window looks up position 20
    stats = [column_stats(c, 8) for c in col]
    keys = [torch.zeros(1, m, 4)] * layers

    def plan(**params):
        policy = get_policy("snapkv", pool_kernel=1, **params)
        return policy.plan(stats, keys, keys, alpha=k / m, m=m, tau=0)

    own, shared = plan(), plan(layer_share=0.5)
    assert [20 in p[0].tolist() for p in own] == [False, False, True]
    assert all(20 in p[0].tolist() for p in shared)
    assert all(p.shape == (1, k) and len(set(p[0].tolist())) == k for p in shared)  # the budget is exact
    with pytest.raises(ValueError, match="layer_share"):
        get_policy("vlcache", layer_share=1.5)


@pytest.mark.parametrize(
    "name",
    [
        "vlcache_text",
        "vlcache_text_lowbudget",
        "vlcache_lookup",
        "vlcache_text_span",
        "vlcache_text_lean_w24_skip32",
    ],
)
def test_text_preset_compresses_text_only_prompts_and_leaves_image_prompts_alone(name):
    from vlkv.common.compression import policy_from_dict, preset

    m, layers = 120, 3
    policy, plain, lookup = (
        get_policy("vlcache", text_preset=name),
        get_policy("vlcache", text_preset=""),  # every prompt compressed by vlcache itself
        preset(name),
    )
    window = lookup.text_window
    assert policy.query_start(m, m) == lookup.query_start(m, m) == m - window
    if window != plain.text_window:
        assert policy.query_start(m, m) != plain.query_start(m, m)
    assert policy.query_start(m, 20) == plain.query_start(m, 20) == m - 20
    gen = torch.Generator().manual_seed(3)
    keys = [torch.randn(2, m, 4, generator=gen) for _ in range(layers)]
    for tau, twin in ((m, lookup), (20, plain)):
        stats = [
            column_stats(torch.rand(4, m, generator=gen), m - twin.query_start(m, tau)) for _ in range(layers)
        ]
        ours = policy.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau)
        theirs = twin.compress(stats, keys, keys, alpha=0.2, m=m, tau=tau)
        assert all(torch.equal(a, b) for a, b in zip(ours.kept_indices, theirs.kept_indices, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ours.prompt_scores, theirs.prompt_scores, strict=True))
    # an image prompt's cache is the plain policy's whatever final question the caller counted
    stats = [column_stats(torch.rand(4, m, generator=gen), 20) for _ in range(layers)]
    ours = policy.compress(stats, keys, keys, alpha=0.2, m=m, tau=20, question=30)
    theirs = plain.compress(stats, keys, keys, alpha=0.2, m=m, tau=20)
    assert all(torch.equal(a, b) for a, b in zip(ours.kept_indices, theirs.kept_indices, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours.prompt_scores, theirs.prompt_scores, strict=True))
    assert policy_from_dict(policy.to_dict()) == policy
    for bad, message in (
        ({"text_preset": "nope"}, "unknown compression preset"),
        ({"text_preset": 1}, "str"),
    ):
        with pytest.raises(ValueError, match=message):
            policy_from_dict({"policy": "vlcache", **bad})
    # a policy that chooses its own query rows hands text-only prompts on as well: each prompt's rows are
    # those of the policy that compresses it
    snap = get_policy("snapkv", text_preset=name)
    assert snap.query_start(m, m) == lookup.query_start(m, m)
    assert snap.query_start(m, 20) == get_policy("snapkv").query_start(m, 20)
