"""Policies as composable parts: allocators hold their own parameters, every policy / allocator / preset
round-trips through a plain JSON dict with validation, and the flat keywords build the same policies."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from policy_stats import TAU, L, M, make_inputs, stats_for
from vlkv.common.compression import (
    POLICY_NAMES,
    PRESETS,
    Coverage,
    Mixed,
    Policy,
    Pyramid,
    Sparsity,
    Uniform,
    allocator_from_dict,
    allocator_names,
    get_allocator,
    get_policy,
    policy_from_dict,
    preset,
    preset_params,
    recent_count,
)


def assert_same_plans(a, b, seed: int, alpha: float = 0.2) -> None:
    qs, ks, vs = make_inputs(4, 2, seed=seed)
    stats = stats_for(a, qs, ks)
    plans = [p.plan(stats, ks, vs, alpha=alpha, m=M, tau=TAU) for p in (a, b)]
    assert all(torch.equal(x, y) for x, y in zip(*plans, strict=True))


@pytest.mark.parametrize("name", allocator_names())
def test_every_allocator_round_trips(name):
    default = get_allocator(name)
    data = json.loads(json.dumps(default.to_dict()))
    assert data["name"] == name and allocator_from_dict(data) == default


@pytest.mark.parametrize("allocator", allocator_names())
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_round_trips_and_plans_the_same(name, allocator):
    policy = get_policy(name, allocator=allocator)
    again = policy_from_dict(json.loads(json.dumps(policy.to_dict())))
    assert again == policy and again.allocator.name == allocator
    assert_same_plans(policy, again, seed=11)


@pytest.mark.parametrize(
    ("flat", "composed"),
    [
        ({"allocator": "pyramid", "pyramid_beta": 2.0}, {"allocator": Pyramid(beta=2.0)}),
        # the name of another kind than vlcache's own (draft mass): that kind's registered default
        ({"allocator": "pyramid"}, {"allocator": Pyramid(beta=20.0)}),
        ({"pyramid_beta": 2.0}, {}),  # vlcache's own allocator is not a pyramid: checked, then ignored
        ({"allocator": "draft_mass"}, {}),  # the name of vlcache's own kind keeps its parameters
        ({"allocator": "mixed", "adaptive_weight": 0.5}, {"allocator": Mixed(weight=0.5)}),
        ({"allocator": "coverage", "coverage_mass": 0.7}, {"allocator": Coverage(mass=0.7)}),
        ({"allocator": "sparsity", "exact_budget": True}, {"allocator": Sparsity(exact=True)}),
        ({"allocator": "uniform", "pyramid_beta": 3.0}, {"allocator": Uniform()}),  # another kind's: ignored
        ({"allocator": {"name": "pyramid", "beta": 2.0}}, {"allocator": Pyramid(beta=2.0)}),
    ],
)
def test_flat_keywords_build_the_composed_policy(flat, composed):
    a, b = get_policy("vlcache", **flat), get_policy("vlcache", **composed)
    assert a == b
    qs, ks, vs = make_inputs(4, 2, seed=12)
    stats = stats_for(a, qs, ks)
    assert a.allocate(stats, 0.1, M, L) == b.allocate(stats, 0.1, M, L)


def test_snapkv_with_a_pyramid_name_gets_pyramidkvs_allocator():
    assert (
        get_policy("snapkv", allocator="pyramid").allocator == get_policy("pyramidkv").allocator == Pyramid()
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"policy": "vlcache", "pool_kernell": 3}, "unknown option.*'pool_kernell'"),
        ({"policy": "vlcache", "pool_kernel": 4}, "pool_kernel must be a positive odd"),
        ({"policy": "vlcache", "pool_kernel": 3.0}, r"pool_kernel: expected int"),
        ({"policy": "vlcache", "post_vision_window": 1}, "expected bool"),
        ({"policy": "vlcache", "post_vision_cap": 2}, "post_vision_cap must be in"),
        ({"policy": "vlcache", "allocator": {"name": "pyramid", "beta": 0.5}}, "beta must be >= 1"),
        ({"policy": "vlcache", "allocator": {"name": "pyramid", "b": 2}}, "unknown option.*'b'"),
        ({"policy": "vlcache", "allocator": {"name": "magic"}}, "unknown allocator 'magic'"),
        ({"policy": "vlcache", "allocator": {"name": "mixed", "weight": "x"}}, "expected float"),
        ({"policy": "magic"}, "unknown compression policy 'magic'"),
        ({"pool_kernel": 3}, "'policy' name"),
        ({"policy": "snapkv", "window": 0}, "window must be >= 1"),
        ({"policy": "h2o", "window": 8}, "unknown option.*'window'"),
    ],
)
def test_bad_dicts_are_clear_errors(data, message):
    with pytest.raises(ValueError, match=message):
        policy_from_dict(data)


def test_presets_are_policies_and_the_paper_preset_is_the_zoo_before_row():
    for name in PRESETS:
        assert policy_from_dict(preset(name).to_dict()) == preset(name)
    paper = preset("vlcache_paper")
    assert paper.allocator == Sparsity() and paper.pool_kernel == 1 and paper.post_vision_window
    assert get_policy("vlcache", **preset_params("vlcache_paper")) == paper
    assert preset("vlcache_default") == get_policy("vlcache")
    # the zoo's "before" row as it was spelled before the preset existed
    legacy = {
        "allocator": "sparsity",
        "post_vision_cap": 0.5,
        "post_vision_by_score": False,
        "pool_kernel": 1,
        "post_vision_window": True,  # the default's then (today's keeps no window)
    }
    assert_same_plans(get_policy("vlcache", pyramid_beta=20.0, **legacy), paper, seed=13, alpha=0.1)
    with pytest.raises(ValueError, match="unknown compression preset"):
        preset("nope")


def test_text_lookahead_presets_are_vlcache_text_span_with_a_draft():
    """The text-draft candidates differ from vlcache_text_span only in the draft's length and weight."""
    span = preset("vlcache_text_span")
    assert span.lookahead == 0
    for name, k, w in [
        ("vlcache_text_span_lookahead", 16, 0.5),
        ("vlcache_text_span_lookahead32", 32, 0.5),
        ("vlcache_text_span_lookahead32_w1", 32, 1.0),
        ("vlcache_text_span_lookahead48", 48, 0.5),
        ("vlcache_text_span_lookahead48_w1", 48, 1.0),
    ]:
        policy = preset(name)
        assert (policy.lookahead, policy.lookahead_weight) == (k, w)
        assert isinstance(policy, Policy)  # a plain policy: it compresses text-only prompts itself
        assert dataclasses.replace(policy, lookahead=0, lookahead_weight=span.lookahead_weight) == span


def test_lean_text_presets_fix_fewer_slots_than_vlcache_text_span():
    """vlcache_text_lean: vlcache_text_span with a 20-row window, 12-token spans, no recent window and a
    question share that shrinks below 5% of the prompt (a quarter of the layer at 5% and above, a tenth at
    2%); vlcache_text_lean_sinks2: the same with two sinks and the quarter at every budget."""
    span, lean, sinks2 = (
        preset("vlcache_text_span"),
        preset("vlcache_text_lean"),
        preset("vlcache_text_lean_sinks2"),
    )
    common = {"text_window": 20, "span_after": 12, "recent_ratio": 0.0}
    assert lean == dataclasses.replace(span, post_vision_slope=5.0, **common)
    assert sinks2 == dataclasses.replace(span, sink_tokens=2, **common)
    m = 1024
    k2, k5, k10 = 21, 52, 103  # uniform layer budgets at 2 / 5 / 10%
    assert [span.post_vision_share(k, m) for k in (k2, k5, k10)] == [5, 13, 25]
    assert [sinks2.post_vision_share(k, m) for k in (k2, k5, k10)] == [5, 13, 25]
    assert [lean.post_vision_share(k, m) for k in (k2, k5, k10)] == [2, 13, 25]


def test_text_only_prompts_use_an_observation_window():
    """No vision tokens (tau = m), no text preset: the last 32 rows score the rest and, with the question's
    window on, are kept like a question (by default the preset vlcache_text_span does that with 24 rows)."""
    m, k = 200, 40
    assert get_policy("vlcache").query_start(m, m) == m - preset("vlcache_text_span").text_window == m - 24
    policy = get_policy("vlcache", text_preset="", post_vision_window=True)
    assert policy.text_window == 32 and policy.query_start(m, m) == m - 32
    assert preset("vlcache_paper").query_start(m, m) == 0  # the paper: every row is post-vision
    assert policy.query_start(20, 20) == 0  # a prompt shorter than the window: every row
    assert policy.query_start(m, 10) == m - 10  # image prompts are unchanged
    qs, ks, vs = make_inputs(4, 2, seed=14, m=m)
    stats = stats_for(policy, qs, ks, m=m, tau=m)
    assert stats[0].row_max.shape == (4, 32)
    kept = policy.plan(stats, ks, vs, alpha=k / m, m=m, tau=m)
    budgets = policy.allocate(stats, k / m, m, len(ks))
    for layer, (idx, k_l) in enumerate(zip(kept, budgets, strict=True)):
        window = min(32, k_l // 2) + recent_count(k_l)  # the observation window, the recent 10% before it
        window = min(window, k_l)
        assert bool((idx[:, k_l - window :] == torch.arange(m - window, m)).all())
        scores = policy.score(layer, stats[layer], ks[layer], vs[layer], m, m)
        for h in range(2):
            older = scores[h, : m - window]
            got = sorted(older[idx[h, : k_l - window]].tolist(), reverse=True)
            assert got == sorted(older.tolist(), reverse=True)[: k_l - window]


def test_a_registered_preset_is_known_and_a_taken_name_or_bad_settings_are_refused():
    from vlkv.common.compression.registry import register_preset as register

    with pytest.raises(ValueError, match="exists already"):
        register("vlcache_default", {"policy": "vlcache", "text_window": 3})
    with pytest.raises(ValueError):
        register("mine_bad", {"policy": "vlcache", "no_such_option": 1})
    assert "mine_bad" not in PRESETS
    register("vlcache_default", PRESETS["vlcache_default"])  # the same again: a re-import, not a clash


def test_the_product_ships_only_presets_a_default_candidate_or_baseline_uses():
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
        "if not getattr(f, '__module__', '').startswith('__editable___vlkv_lab')]\n"
        "from vlkv.common.compression.presets import PRESETS; print(' '.join(sorted(PRESETS)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    shipped = set(run.stdout.split())
    assert "vlcache_text_lean" not in shipped and "vlcache_text_question" not in shipped
    assert {"vlcache_default", "vlcache_paper", "vlcache_text_by_budget", "vlcache_text_span"} <= shipped
