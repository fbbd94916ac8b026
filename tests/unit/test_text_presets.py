"""The text-only presets (``presets.py``, ``text_preset``): what ``vlcache_text_lowbudget`` keeps on a
constructed window-attention pattern at a small budget, against ``vlcache_text``, and its registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import vlkv_lab.eval.presets  # noqa: F401  (the lab's presets: the experiments this names)
from policy_stats import column_stats
from vlkv.common.compression import get_policy, policy_from_dict, preset
from vlkv.common.compression.allocators import Pyramid

M, LAYERS, KEY, WINDOW = 1000, 4, 300, 16
VALUE = range(KEY + 1, KEY + 7)  # the six tokens after the one the window looks up


def _plan(name: str, alpha: float) -> list[torch.Tensor]:
    """A text-only prompt (tau = m) whose 16-row window looks up position KEY in every layer, attends to the
    first tokens (sinks) and to itself, and to nothing else."""
    col = torch.full((2, M), 0.01)
    col[:, KEY] = 5.0
    col[:, :4] = 3.0
    col[:, M - WINDOW :] = 1.0
    stats = [column_stats(col.clone(), WINDOW) for _ in range(LAYERS)]
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
    from vlkv_lab.eval.protocol_kinds import text_rows
    from vlkv_lab.eval.zoo import ABLATION

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = "text-only prompts: preset vlcache_text_lowbudget"
    assert rows[label] == {"policy": "vlcache", "params": {"text_preset": "vlcache_text_lowbudget"}}
    assert label in text_rows(rows, "vlcache (defaults)")


QUESTION_KEY = M - 20  # the question names the key 20 tokens before the prompt's end (a RULER-style question)
LONG_VALUE = range(KEY + 1, KEY + 13)  # "is", ":", " " and a 7-digit number, one token each, and a "."


def _rows_stats(policy, layers: int = LAYERS) -> list[SimpleNamespace]:
    """Statistics over ``policy``'s own query rows of a text-only prompt: the row of the question's key
    (``QUESTION_KEY``) looks up ``KEY`` in the context; every row also attends to the sinks, a little (kept
    outright anyway), and to itself."""
    q0 = policy.query_start(M, M)
    attn = torch.zeros(2, M - q0, M)
    attn[:, :, :4] = 0.01
    for r, i in enumerate(range(q0, M)):
        attn[:, r, i] = 0.5
        if i == QUESTION_KEY:
            attn[:, r, KEY] = 0.7
    return [column_stats(attn.sum(dim=1), M - q0) for _ in range(layers)]


def _kept_value(name: str, alpha: float) -> list[int]:
    policy = get_policy("vlcache", text_preset=name)
    keys = [torch.zeros(1, M, 4)] * LAYERS
    plan = policy.plan(_rows_stats(policy.for_prompt(M, M)), keys, keys, alpha=alpha, m=M, tau=M)
    return [sum(v in k[0].tolist() for v in LONG_VALUE) for k in plan]


def test_text_span_keeps_a_long_value_the_question_looks_up_outside_a_16_token_window():
    # vlcache_lookup's 16-row window ends after the question's key: no row of it looks up the value
    assert _kept_value("vlcache_lookup", 0.05) == [0] * LAYERS
    # vlcache_text_span's 24 rows hold the key's row, and its 16-token spans carry all 12 tokens after KEY
    assert _kept_value("vlcache_text_span", 0.05) == [len(LONG_VALUE)] * LAYERS


def test_text_span_is_vlcache_lookup_with_a_question_sized_window_and_longer_spans():
    lookup, span = preset("vlcache_lookup"), preset("vlcache_text_span")
    assert (span.text_window, span.span_after) == (24, 16)
    assert (lookup.text_window, lookup.span_after) == (16, 8)
    same = {k: v for k, v in span.to_dict().items() if k not in ("text_window", "span_after")}
    assert same == {k: v for k, v in lookup.to_dict().items() if k not in ("text_window", "span_after")}
    assert policy_from_dict(span.to_dict()) == span


@pytest.mark.parametrize(
    "name",
    [
        "vlcache_lookup",
        "vlcache_text_span",
        "vlcache_text_lean",
        "vlcache_text_lean_sinks2",
        "vlcache_text_lean_w24",
        "vlcache_text_lean_w24_skip32",
        "vlcache_text_span_skip32",
    ],
)
def test_text_preset_rows_the_protocol_reads_as_text_presets(name):
    from vlkv_lab.eval.protocol_kinds import text_rows
    from vlkv_lab.eval.zoo import ABLATION

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = f"text-only prompts: preset {name}"
    assert rows[label] == {"policy": "vlcache", "params": {"text_preset": name}}
    assert label in text_rows(rows, "vlcache (defaults)")


def test_lean_presets_keep_the_long_value_at_2_percent_where_text_span_runs_out():
    # at 2% (20 slots a layer) vlcache_text_span's sinks, recent window and question share leave room for 7 of
    # the value's 12 tokens; without the recent window, with 12-token spans and the question's share shrunk
    # (lean) or two sinks (lean_sinks2), the scored slots hold all or all but one
    assert _kept_value("vlcache_text_span", 0.02) == [7] * LAYERS
    assert _kept_value("vlcache_text_lean", 0.02) == [len(LONG_VALUE)] * LAYERS
    assert _kept_value("vlcache_text_lean_sinks2", 0.02) == [len(LONG_VALUE) - 1] * LAYERS
    assert _kept_value("vlcache_text_lean", 0.05) == [len(LONG_VALUE)] * LAYERS


def test_lean_w24_is_lean_with_the_default_window_and_keeps_its_2_percent_value():
    lean, w24 = preset("vlcache_text_lean"), preset("vlcache_text_lean_w24")
    assert (w24.text_window, lean.text_window) == (24, 20) == (preset("vlcache_text_span").text_window, 20)
    same = {k: v for k, v in w24.to_dict().items() if k != "text_window"}
    assert same == {k: v for k, v in lean.to_dict().items() if k != "text_window"}
    assert policy_from_dict(w24.to_dict()) == w24
    # the 24 rows still hold the question's key row, and without the recent window the 12-token spans fit the
    # whole value at 2% where vlcache_text_span keeps 7 of its 12 tokens
    assert _kept_value("vlcache_text_lean_w24", 0.02) == [len(LONG_VALUE)] * LAYERS
    assert _kept_value("vlcache_text_lean_w24", 0.05) == [len(LONG_VALUE)] * LAYERS


@pytest.mark.parametrize(
    ("name", "parent"),
    [
        ("vlcache_text_lean_w24_skip32", "vlcache_text_lean_w24"),
        ("vlcache_text_span_skip32", "vlcache_text_span"),
    ],
)
def test_skip32_presets_are_their_parents_with_the_first_32_positions_spreading_half(name, parent):
    child, base = preset(name), preset(parent)
    assert (child.span_skip, child.span_skip_weight) == (32, 0.5) and base.span_skip == 0
    same = {k: v for k, v in child.to_dict().items() if k not in ("span_skip", "span_skip_weight")}
    assert same == {k: v for k, v in base.to_dict().items() if k not in ("span_skip", "span_skip_weight")}
    assert policy_from_dict(child.to_dict()) == child
    # the constructed RULER prompt's key sits past the first 32 positions: the same value kept as the parent
    assert _kept_value(name, 0.05) == _kept_value(parent, 0.05) == [len(LONG_VALUE)] * LAYERS
