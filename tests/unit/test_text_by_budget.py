"""``routing.ByBudget`` (``low_budget_preset`` / ``low_budget_below`` by name) and the preset
``vlcache_text_by_budget``: a text-only prompt at a budget below 7.5% goes to ``vlcache_text_lean_w24_skip32``,
at or above it to ``vlcache_text_span``; image prompts and the statistics rows are the same at every budget."""

from __future__ import annotations

import json

import pytest
import torch
import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from policy_stats import TEXT_LAYERS, TEXT_M, random_text_stats
from vlkv.common.compression import ByBudget, get_policy, policy_from_dict, preset
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, read_profile

M, LAYERS = TEXT_M, TEXT_LAYERS
BY_BUDGET, LOW, HIGH = "vlcache_text_by_budget", "vlcache_text_lean_w24_skip32", "vlcache_text_span"


def _plan(text_preset: str, alpha: float, tau: int = M, seed: int = 0) -> list[list[list[int]]]:
    policy = get_policy("vlcache", text_preset=text_preset)
    keys = [torch.zeros(3, M, 4)] * LAYERS
    stats = random_text_stats(policy.query_start(M, tau), seed)
    plan = policy.plan(stats, keys, keys, alpha=alpha, m=M, tau=tau)
    return [k.tolist() for k in plan]


def test_the_switch_hands_budgets_below_the_threshold_to_the_low_preset_and_keeps_its_own_above():
    policy = preset(BY_BUDGET)
    assert isinstance(policy, ByBudget) and policy.below == 0.075
    assert policy.low == preset(LOW) and policy.high == preset(HIGH)  # policy objects, not names
    for alpha in (0.01, 0.02, 0.05, 0.0749):
        assert policy.for_prompt(M, M, alpha) == preset(LOW)
    for alpha in (0.075, 0.1, 0.5, 1.0):
        assert policy.for_prompt(M, M, alpha) == preset(HIGH)
    assert policy.name == preset(HIGH).name


@pytest.mark.parametrize("seed", [0, 1])
def test_a_text_only_prompt_is_kept_as_skip32_keeps_it_below_7_5_percent_and_as_span_keeps_it_above(seed):
    for alpha, same in ((0.01, LOW), (0.02, LOW), (0.05, LOW), (0.1, HIGH), (0.2, HIGH)):
        other = HIGH if same == LOW else LOW
        got = _plan(BY_BUDGET, alpha, seed=seed)
        assert got == _plan(same, alpha, seed=seed)
        assert got != _plan(other, alpha, seed=seed)  # the two presets differ here: the test can tell


def test_image_prompts_and_the_statistics_rows_do_not_depend_on_the_budget():
    policy, default = get_policy("vlcache", text_preset=BY_BUDGET), get_policy("vlcache")
    for alpha in (0.02, 0.05, 0.1):
        assert _plan(BY_BUDGET, alpha, tau=40) == _plan("", alpha, tau=40)
        assert policy.for_prompt(M, 40, alpha) is policy.image  # an image prompt: vlcache itself
        assert default.text == preset(BY_BUDGET)  # the default's text-only prompts
        assert policy.lookahead_steps(alpha, M, M) == 0
    # the rows the statistics cover are read before the budget is known: the same for both presets
    assert policy.query_start(M, M) == preset(LOW).query_start(M, M) == preset(HIGH).query_start(M, M)
    assert policy.requires_stats


def test_the_preset_and_a_policy_naming_it_round_trip_through_json_and_a_profile(tmp_path):
    low = preset(BY_BUDGET)
    data = json.loads(json.dumps(low.to_dict()))
    assert data["policy"] == "by_budget" and data["below"] == 0.075
    assert data["low"] == preset(LOW).to_dict() and data["high"] == preset(HIGH).to_dict()
    assert policy_from_dict(data) == low
    policy = get_policy("vlcache", text_preset=BY_BUDGET)
    assert policy_from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    own = get_policy(
        "vlcache", **_params({"low_budget_preset": "vlcache_text_span_skip32", "low_budget_below": 0.03})
    )
    profile = CompressionProfile(
        model={"fingerprint": "abc"},
        prompts={"digest": "0" * 64, "count": 1},
        measure={"tokens": 8},
        entries=[
            ProfileEntry(budget=0.05, candidate="by budget", policy=policy),
            ProfileEntry(0.1, "own", own),
        ],
    )
    profile.write(tmp_path / "compression_profile.json")
    again = read_profile(tmp_path / "compression_profile.json")
    assert again.policy_for(0.05) == policy and again.policy_for(0.1) == own
    assert again.policy_for(0.1).for_prompt(M, M, 0.02) == preset("vlcache_text_span_skip32")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"low_budget_preset": LOW, "low_budget_below": 0.0}, "go together"),
        ({"low_budget_preset": LOW, "low_budget_below": 1.0}, "go together"),
        ({"low_budget_preset": LOW, "low_budget_below": 1.5}, "low_budget_below"),
        ({"low_budget_preset": LOW, "low_budget_below": -0.1}, "low_budget_below"),
        ({"low_budget_below": 0.075}, "go together"),
        ({"low_budget_preset": "no_such_preset", "low_budget_below": 0.075}, "unknown compression preset"),
        ({"low_budget_preset": BY_BUDGET, "low_budget_below": 0.05}, "hands prompts on itself"),
        ({"low_budget_preset": "vlcache_text_lean", "low_budget_below": 0.05}, "other statistics rows"),
    ],
)
def test_validation_rejects_a_bad_threshold_or_preset(params, match):
    with pytest.raises(ValueError, match=match):
        get_policy("vlcache", **_params(params))
    with pytest.raises(ValueError, match=match):
        policy_from_dict(preset(HIGH).to_dict() | params)


def _params(params: dict) -> dict:
    """``vlcache_text_span``'s keywords with ``params`` over them."""
    data = preset(HIGH).to_dict() | params
    data.pop("policy")
    return data


def test_the_ablation_row_is_read_by_the_protocol_as_a_text_preset():
    from vlkv_lab.eval.protocol_kinds import text_rows
    from vlkv_lab.eval.zoo import ABLATION

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = f"text-only prompts: preset {BY_BUDGET}"
    assert rows[label] == {"policy": "vlcache", "params": {"text_preset": BY_BUDGET}}
    assert label in text_rows(rows, "vlcache (defaults)")
