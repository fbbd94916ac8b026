"""The text-only presets (``presets.py``, ``text_preset``): what ``vlcache_text_lowbudget`` keeps on a
constructed window-attention pattern at a small budget, against ``vlcache_text``, and its registration."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vlkv.common.compression import get_policy, policy_from_dict, preset
from vlkv.common.compression.allocators import Pyramid

M, LAYERS, KEY, WINDOW = 1000, 4, 300, 16
VALUE = range(KEY + 1, KEY + 7)  # the six tokens after the one the window looks up


def _stats(col_sum: torch.Tensor, tq: int) -> SimpleNamespace:
    heads, m = col_sum.shape
    return SimpleNamespace(
        row_max=torch.zeros(heads, tq),
        row_sumexp=torch.ones(heads, tq),
        col_sum=col_sum,
        below=torch.zeros(heads),
        unmasked=torch.full((heads,), float(tq * m)),
    )


def _plan(name: str, alpha: float) -> list[torch.Tensor]:
    """A text-only prompt (tau = m) whose 16-row window looks up position KEY in every layer, attends to the
    first tokens (sinks) and to itself, and to nothing else."""
    col = torch.full((2, M), 0.01)
    col[:, KEY] = 5.0
    col[:, :4] = 3.0
    col[:, M - WINDOW :] = 1.0
    stats = [_stats(col.clone(), WINDOW) for _ in range(LAYERS)]
    keys = [torch.zeros(1, M, 4)] * LAYERS
    policy = get_policy("vlcache", text_preset=name)
    return policy.plan(stats, keys, keys, alpha=alpha, m=M, tau=M)


def test_lowbudget_keeps_the_value_after_the_looked_up_token_where_vlcache_text_runs_out():
    text, low = _plan("vlcache_text", 0.02), _plan("vlcache_text_lowbudget", 0.02)
    assert sum(k.shape[1] for k in text) == sum(k.shape[1] for k in low) == 80  # the same total
    value_kept = [[sum(v in k[0].tolist() for v in VALUE) for k in plan] for plan in (text, low)]
    assert value_kept == [[6, 6, 4, 0], [6, 6, 6, 2]]  # the deep layers keep more of the value
    # no recent window: the context's last tokens before the question window are not kept for their place
    before = set(range(M - WINDOW - 20, M - WINDOW))
    assert any(before & set(k[0].tolist()) for k in text)
    assert not any(before & set(k[0].tolist()) for k in low)
    assert all(set(range(4)) <= set(k[0].tolist()) for k in low)  # the sinks stay


def test_lowbudget_is_vlcache_text_without_the_recent_window_and_with_a_gentler_pyramid():
    text, low = preset("vlcache_text"), preset("vlcache_text_lowbudget")
    assert low.recent_ratio == 0.0 and low.allocator == Pyramid(beta=2.0)
    assert policy_from_dict(low.to_dict()) == low
    same = {k: v for k, v in low.to_dict().items() if k not in ("recent_ratio", "allocator")}
    assert same == {k: v for k, v in text.to_dict().items() if k not in ("recent_ratio", "allocator")}
    policy = get_policy("vlcache", text_preset="vlcache_text_lowbudget")
    assert policy_from_dict(policy.to_dict()) == policy and policy.for_prompt(M, M) == low


def test_lowbudget_has_an_ablation_row_the_protocol_reads_as_a_text_preset():
    from vlkv.tools.eval.protocol_kinds import text_rows
    from vlkv.tools.eval.zoo import ABLATION

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = "text-only prompts: preset vlcache_text_lowbudget"
    assert rows[label] == {"policy": "vlcache", "params": {"text_preset": "vlcache_text_lowbudget"}}
    assert label in text_rows(rows, "vlcache (defaults)")
