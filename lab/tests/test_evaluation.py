"""The evaluation harness decodes exactly what the served path decodes."""

from __future__ import annotations

import pytest
import torch
from inproc_cluster import evaluation_cluster
from vlkv.common.compression.registry import get_policy
from vlkv.deploy.client import build_request, generate, png_bytes
from vlkv.deploy.synthetic_task import prompt_text
from vlkv_lab.eval.evaluation import cache_hit_rate, compress, decode_batch, evaluate


@pytest.fixture(scope="module")
def setup(tiny_model_dirs):
    cluster, examples, prepared = evaluation_cluster(tiny_model_dirs("llava-gqa"), 3, seed=1)
    yield cluster, examples, prepared
    cluster.close()


def test_full_cache_decode_equals_generate(setup):
    cluster, examples, prepared = setup
    eos = cluster.processor.tokenizer.eos_token_id
    outs = decode_batch(cluster.model, [compress(p, "full", 1.0) for p in prepared], 6, {eos})
    for ex, out in zip(examples, outs, strict=True):
        inputs = cluster.processor(
            images=ex.images, text=prompt_text(cluster.processor, ex), return_tensors="pt"
        )
        with torch.inference_mode():
            ref = cluster.model.generate(**inputs, max_new_tokens=6, do_sample=False)[
                0, inputs["input_ids"].shape[1] :
            ]
        assert out == ref.tolist()[: len(out)]


@pytest.mark.parametrize("policy", ["vlcache", "snapkv", "streamingllm"])
def test_compressed_decode_equals_served_tokens(setup, policy):
    cluster, examples, prepared = setup
    eos = cluster.processor.tokenizer.eos_token_id
    outs = decode_batch(cluster.model, [compress(p, policy, 0.3) for p in prepared], 6, {eos})
    for ex, out in zip(examples, outs, strict=True):
        req = build_request(
            images=[png_bytes(i) for i in ex.images],
            question=ex.question,
            max_new_tokens=6,
            policy=policy,
            budget=0.3,
        )
        served = generate(cluster.stub, req, timeout=60)
        assert served.token_ids == [t for t in out if t != eos]


def test_cache_hit_rate_is_a_share_and_full_budget_hits_everything(setup):
    _, _, prepared = setup
    rates = cache_hit_rate(prepared[0], "vlcache", 0.1)
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)
    assert cache_hit_rate(prepared[0], "h2o", 1.0) == [1.0, 1.0, 1.0]


def test_cache_hit_rate_takes_a_truth_and_policy_params(setup):
    _, _, prepared = setup
    p = prepared[0]
    assert cache_hit_rate(p, "vlcache", 0.2, truth=p.next_attention) == cache_hit_rate(p, "vlcache", 0.2)
    assert cache_hit_rate(p, "snapkv", 1.0, truth=p.next_attention, pool_kernel=1) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        cache_hit_rate(p, "vlcache", 0.1, no_such_parameter=1)


def test_evaluate_passes_policy_params(setup):
    cluster, _, prepared = setup
    res = evaluate(cluster.model, cluster.processor, prepared, "vlcache", 0.3, 4, allocator="pyramid")
    layers = len(prepared[0].keys)
    budgets = [get_policy("vlcache", allocator="pyramid").allocate(None, 0.3, p.m, layers) for p in prepared]
    want = [
        sum(b[i] / p.m for b, p in zip(budgets, prepared, strict=True)) / len(prepared) for i in range(layers)
    ]
    assert res.layer_budget_share == pytest.approx(want)
    assert len(res.answers) == len(prepared)
