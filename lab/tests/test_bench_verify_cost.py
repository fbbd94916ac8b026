"""``lab/vlkv_lab/bench/verify_cost.py`` on the tiny LLaVA (behaviour, not timings): a row per configuration and
prompt group, shares of the prefill worker's time in [0, 1], no verification time where nothing is verified,
and the 7B cost model's rows."""

from __future__ import annotations

import pytest
from sample_images import random_png
from vlkv.common.compression.verify import VerifyConfig
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.deploy.inprocess import InProcessEngine
from vlkv_lab.bench.verify_cost import (
    CONFIGS,
    Prompt,
    measure,
    model_rows,
    model_table,
    summarize,
    table,
)

Q = "what colour is the square ?"


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    cfg = ModelConfig(path=tiny_model_dirs("llava-gqa"))
    return InProcessEngine(load_model(cfg), load_processor(cfg.path), verify=VerifyConfig())


def test_a_row_per_configuration_with_shares_of_the_prefill(engine):
    prompts = [Prompt("image", question=Q, images=(random_png(1),)), Prompt("text", question=Q)]
    records = measure(engine, prompts, 0.1, warmup=False)
    assert len(records) == len(prompts) * len(CONFIGS)
    rows = summarize(records)
    assert [(r["group"], r["config"]) for r in rows] == [(g, c) for g in ("image", "text") for c in CONFIGS]
    for r in rows:
        assert r["n"] == 1 and r["req_s"] > 0 and r["p50_ms"] <= r["p99_ms"]
        assert 0.0 <= r["draft_share"] <= 1.0 and 0.0 <= r["verify_share"] <= 1.0
        assert r["draft_share"] + r["verify_share"] <= 1.0 and 0.0 < r["ratio"] <= 1.0
        verified = r["config"] in ("floor", "select")
        assert (r["verify_share"] > 0) == verified and (r["draft_share"] > 0 or not verified)
        if not verified:
            assert r["raises"] == 0
        if r["config"] == "lookahead off":
            assert r["draft_share"] == 0
    by = {(r["group"], r["config"]): r for r in rows}
    assert by["image", "default"]["draft_share"] > 0  # vlcache's image path drafts 16 tokens (lookahead)
    md = table(rows)
    assert md.count("\n") == 1 + len(rows) and "| image | floor |" in md


def test_the_7b_cost_model_rows():
    rows = model_rows((1024, 2048))
    assert {r["gpu"] for r in rows} == {"H100", "H200"} and {r["m"] for r in rows} == {1024, 2048}
    for r in rows:
        assert 0.0 <= r["draft_share"] + r["verify_share"] <= 1.0
        assert (r["verify_share"] > 0) == ("select" in r["config"] or "floor" in r["config"])
        assert r["ms"][0] > 0 and all(x >= 0 for x in r["ms"])
    two = [r for r in rows if r["config"].startswith("floor")]
    one = [r for r in rows if r["config"].startswith("select")]
    assert all(a["ms"][2] > b["ms"][2] for a, b in zip(two, one, strict=True))  # more rounds cost more
    assert model_table(rows).count("\n") == 1 + len(rows)


def test_draft_batch_rows_time_both_ways_per_group(engine):
    from vlkv_lab.bench.draft_batch import draft_batch_rows, draft_batch_table

    prompts = [Prompt("g", question="what colour is the square ?", images=(random_png(i),)) for i in range(3)]
    [row] = draft_batch_rows(engine, prompts, batch=2, steps=4, repeats=1)
    assert row["group"] == "g" and row["batch"] == 2 and row["serial_ms"] > 0 and row["batched_ms"] > 0
    assert "| g | 2 |" in draft_batch_table([row])
