"""The lab policy's ``post_vision_max`` (``vlkv_lab.eval.lab_policy``) and the preset ``vlcache_text_lean_w24_skip32_q12``: the question window stops
growing at 12 slots, so on a text-only prompt of 1,000 tokens (50 slots a layer at 5%) the preset is
``vlcache_text_lean_w24_skip32`` slot for slot at 1-5% and, at 10%, keeps the question's last 12 tokens and
adds scored ones (its 5% selection inside)."""

from __future__ import annotations

import json

import pytest
import torch
import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from policy_stats import TEXT_M as M
from policy_stats import random_text_stats
from vlkv.common.compression import get_policy, policy_from_dict, preset
from vlkv.common.compression.selection import post_vision_share

Q12, SKIP32 = "vlcache_text_lean_w24_skip32_q12", "vlcache_text_lean_w24_skip32"
LAYERS = 4


def _plan(text_preset: str, alpha: float, seed: int = 0) -> list[list[set[int]]]:
    """Kept positions per layer and KV head of a text-only prompt of ``M`` tokens (random statistics)."""
    policy = get_policy("vlcache", text_preset=text_preset)
    keys = [torch.zeros(3, M, 4)] * LAYERS
    stats = random_text_stats(policy.query_start(M, M), seed)
    return [[set(h.tolist()) for h in k] for k in policy.plan(stats, keys, keys, alpha=alpha, m=M, tau=M)]


def test_the_share_is_capped_only_when_set():
    k, m = 100, 1000
    for cap, slope in ((0.25, 0.0), (0.25, 5.0), (0.5, 0.0)):
        plain = get_policy("vlcache_lab", text_preset="", post_vision_cap=cap, post_vision_slope=slope)
        capped = get_policy(
            "vlcache_lab", text_preset="", post_vision_cap=cap, post_vision_slope=slope, post_vision_max=12
        )
        assert plain.post_vision_share(k, m) == post_vision_share(k, m, cap, slope) > 12
        assert capped.post_vision_share(k, m) == 12
        for small in (20, 40):  # below the cap: unchanged
            assert capped.post_vision_share(small, m) == min(12, post_vision_share(small, m, cap, slope))
    with pytest.raises(ValueError, match="post_vision_max"):
        get_policy("vlcache_lab", post_vision_max=-1)


def test_the_preset_is_skip32_with_the_cap_and_round_trips_through_json():
    policy = preset(Q12)
    data = json.loads(json.dumps(policy.to_dict()))
    assert data["post_vision_max"] == 12 and policy_from_dict(data) == policy
    lab = ("policy", "post_vision_max", "post_vision_layers", "question_min", "question_max", "chunk_size")
    assert data["policy"] == "vlcache_lab" and (data["post_vision_layers"], data["chunk_size"]) == (0, 1)
    own = {k: v for k, v in data.items() if k not in lab}
    assert own == {k: v for k, v in preset(SKIP32).to_dict().items() if k != "policy"}
    k10 = policy.allocate(None, 0.1, M, LAYERS)[0]
    assert policy.post_vision_share(k10, M) == 12 < preset(SKIP32).post_vision_share(k10, M)
    named = get_policy("vlcache", text_preset=Q12)
    assert policy_from_dict(json.loads(json.dumps(named.to_dict()))) == named


@pytest.mark.parametrize("seed", [0, 1])
def test_on_a_1k_prompt_it_is_skip32_up_to_5_percent_and_a_superset_of_its_5_percent_at_10(seed):
    for alpha in (0.01, 0.02, 0.05):
        assert _plan(Q12, alpha, seed) == _plan(SKIP32, alpha, seed)
    five, ten, skip_ten = _plan(Q12, 0.05, seed), _plan(Q12, 0.1, seed), _plan(SKIP32, 0.1, seed)
    assert ten != skip_ten  # the cap changes 10%: the test can tell
    question = set(range(M - 24, M))  # the 24-row window
    for layer5, layer10, skip10 in zip(five, ten, skip_ten, strict=True):
        for h5, h10, s10 in zip(layer5, layer10, skip10, strict=True):
            assert h5 <= h10  # a larger budget only adds tokens
            assert len(h10 & question) == len(h5 & question) == 12  # the question's share does not grow
            assert len(s10 & question) == 24  # skip32 keeps the whole window at 10%


def test_the_ablation_row_is_a_text_preset_row():
    from vlkv_lab.eval.protocol_kinds import text_rows
    from vlkv_lab.eval.zoo import ABLATION

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = f"text-only prompts: preset {Q12}"
    assert rows[label] == {"policy": "vlcache", "params": {"text_preset": Q12}}
    assert label in text_rows(rows, "vlcache (defaults)")
