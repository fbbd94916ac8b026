"""The kvpress text-suite harness's own parts, without kvpress: budget <-> compression_ratio, rows with
their n and intervals and their merge with vlkv's, kept-position recovery, and the masked batch decode against plain decoding
over a truly compressed cache (a tiny random Llama)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_llama
from vlkv_lab.eval.kvpress_presses import compression_ratio, kept_fraction, kept_mask
from vlkv_lab.eval.kvpress_report import aggregate, cell_key, merge
from vlkv_lab.eval.zoo_scoring import wilson


@pytest.mark.parametrize("budget", [0.01, 0.02, 0.05, 0.1, 0.5, 1.0])
def test_budget_and_compression_ratio_are_complements(budget):
    r = compression_ratio(budget)
    assert r == pytest.approx(1 - budget)
    assert kept_fraction(r) == pytest.approx(budget)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_budget_outside_range_is_refused(bad):
    with pytest.raises(ValueError):
        compression_ratio(bad)


def _record(press, mode, task, budget, correct, error=""):
    return {
        "press": press,
        "mode": mode,
        "task": task,
        "length": 1024,
        "budget": budget,
        "kept_tokens": 0 if error else 30,
        "cache_tokens": 1000,
        "correct": correct,
        "error": error,
    }


def test_aggregate_counts_pools_tasks_and_keeps_errors_apart():
    recs = [
        _record("SnapKV", "context", "needle", 0.05, True),
        _record("SnapKV", "context", "needle", 0.05, False),
        _record("SnapKV", "context", "kv", 0.05, True),
        _record("SnapKV", "context", "kv", 0.05, False, error="AssertionError: window"),
    ]
    rows = {(r["task"], r["method"]): r for r in aggregate(recs)}
    needle, kv, pooled = rows[("needle", "SnapKV")], rows[("kv", "SnapKV")], rows[("all", "SnapKV")]
    assert (needle["n"], needle["correct"], needle["accuracy"]) == (2, 1, 0.5)
    assert (kv["n"], kv["errors"], kv["error"]) == (1, 1, "AssertionError: window")
    assert (pooled["n"], pooled["correct"]) == (3, 2)
    assert needle["kept_fraction"] == pytest.approx(0.03)
    assert needle["compression_ratio"] == pytest.approx(0.95)
    assert needle["ci95"] == pytest.approx(list(wilson(1, 2)))


def test_merge_puts_vlkv_rows_beside_kvpress_rows_on_the_shared_key():
    kv_rows = aggregate([_record("TOVA", "prompt", "needle", 0.02, True)])
    vlkv_rows = [
        {"task": "needle", "length": 1024, "budget": 0.02, "policy": "vlcache", "accuracy": 0.9, "n": 50}
    ]
    merged = merge(kv_rows, vlkv_rows)
    cell = merged[("needle", 1024, 0.02)]
    assert set(cell) == {"kvpress TOVA (prompt)", "vlkv vlcache"}
    assert cell_key(vlkv_rows[0]) == ("needle", 1024, 0.02)
    with pytest.raises(ValueError):
        merge(kv_rows, vlkv_rows + vlkv_rows)


def test_kept_mask_recovers_the_gathered_positions():
    torch.manual_seed(0)
    keys = torch.randn(3, 50, 8)
    idx = torch.stack([torch.randperm(50)[:7].sort().values for _ in range(3)])
    comp = keys.gather(1, idx[..., None].expand(-1, -1, 8))
    mask = kept_mask(keys, comp)
    for h in range(3):
        assert mask[h].nonzero().flatten().tolist() == idx[h].tolist()
    with pytest.raises(RuntimeError):
        kept_mask(keys, comp + 1.0)


def test_masked_batch_decode_matches_decoding_a_truly_compressed_cache():
    from transformers import DynamicCache
    from vlkv.common.model.cache_kwarg import cache_arg
    from vlkv_lab.eval.kvpress_decode import greedy, stack_caches

    model = tiny_llama(2, eos_token_id=1)
    cfg = model.config
    m = 40
    with torch.inference_mode():
        full = DynamicCache(config=cfg)
        ids = torch.randint(2, 64, (1, m))
        logits = model(input_ids=ids, **cache_arg(model, full), use_cache=True).logits
    first = int(logits[0, -1].argmax())
    keys = [layer.keys[0] for layer in full.layers]
    values = [layer.values[0] for layer in full.layers]
    # a different number of kept positions per layer (as PyramidKV keeps), and the whole cache
    kept = [torch.randperm(m)[:k].sort().values for k in (20, 9)]
    rows = [[torch.zeros(2, m, dtype=torch.bool).index_fill(1, idx, True) for idx in kept]]
    rows.append([torch.ones(2, m, dtype=torch.bool)] * 2)
    got = greedy(model, stack_caches(keys, values, rows), torch.tensor([[first]] * 2), m, 6, set())
    for row_kept, answer in zip([kept, [torch.arange(m)] * 2], got, strict=True):
        cache = DynamicCache(config=cfg)
        for layer, idx in enumerate(row_kept):
            cache.update(keys[layer][:, idx][None], values[layer][:, idx][None], layer)
        want = [first]
        with torch.inference_mode():
            for step in range(5):
                out = model(
                    input_ids=torch.tensor([[want[-1]]]),
                    position_ids=torch.tensor([[m + step]]),
                    **cache_arg(model, cache),
                    use_cache=True,
                )
                want.append(int(out.logits[0, -1].argmax()))
        assert answer == want


def test_vlkv_rows_from_the_zoo_json_cut_to_the_items_kvpress_answered():
    from vlkv_lab.eval.kvpress_report import vlkv_rows

    zoo = {
        "text needle 1K": {
            "hits": {"full": {"1.0": [True, True, False]}, "vlcache": {"0.05": [True, False, True]}}
        },
        "text kv 1K": {
            "hits": {"vlcache": {"0.05": [False, False, True]}},
            "dropped": "full cache 0.4 < 0.9",
        },
        "default": {"hits": {"vlcache": {"0.05": [True]}}},  # a LLaVA member: not a text row
    }
    rows = {
        (r["method"], r["task"], r["budget"]): r
        for r in vlkv_rows(zoo, {("needle", 1024): 2, ("kv", 1024): 2})
    }
    assert rows[("vlcache", "needle", 0.05)]["correct"] == 1 and rows[("vlcache", "needle", 0.05)]["n"] == 2
    assert (
        rows[("full", "needle", 1.0)]["mode"] == "full" and rows[("full", "needle", 1.0)]["accuracy"] == 1.0
    )
    pooled = rows[("vlcache", "all", 0.05)]
    assert (pooled["n"], pooled["correct"], pooled["length"]) == (4, 1, 1024)
    assert rows[("vlcache", "kv", 0.05)]["error"] == "full cache 0.4 < 0.9"
    assert all(r["task"] != "default" for r in rows.values())
