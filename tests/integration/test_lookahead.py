"""Draft-query (lookahead) scoring on an evaluation cluster: off is today's cache bit for bit, the draft is the greedy
continuation, the served prefill compresses exactly as the in-process evaluation does, and a request can ask for
it through the public API. (The options alone: tests/unit/test_lookahead_options.py.)"""

from __future__ import annotations

import pytest
import torch
from inproc_cluster import evaluation_cluster
from vlkv.common.compression.lookahead import DraftStats, with_draft
from vlkv.common.compression.registry import CompressionSettings, get_policy
from vlkv.common.model.inputs import prepare_inputs
from vlkv.common.model.spec import ModelSpec
from vlkv.common.request import PreparedRequest
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.client import build_request, generate, png_bytes
from vlkv.deploy.synthetic_task import prompt_text
from vlkv.prefill_worker.draft_queries import run_draft
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv_lab.eval.evaluation import compress, compress_with, decode_batch, policy_stats

BUDGET = 0.3


@pytest.fixture(scope="module")
def setup(tiny_model_dirs):
    cluster, examples, prepared = evaluation_cluster(tiny_model_dirs("llava-gqa"), 2, seed=3)
    yield cluster, examples, prepared
    cluster.close()


def _same(a, b) -> None:
    for x, y in zip(a.kept_indices, b.kept_indices, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert torch.equal(x, y)


def test_lookahead_zero_is_the_cache_without_drafts_bit_for_bit(setup, monkeypatch):
    cluster, examples, prepared = setup
    policy = get_policy("vlcache", lookahead=0)
    for prep in prepared:
        args = dict(alpha=BUDGET, m=prep.m, tau=prep.tau, first_token=prep.first_token)
        stats = prep.stats(policy.query_start(prep.m, prep.tau), 0.01)
        plain = policy.compress(stats, prep.keys, prep.values, **args)  # no draft anywhere
        _same(compress(prep, "vlcache", BUDGET, lookahead=0), plain)
        # draft rows handed to a policy with lookahead 0 change nothing either
        drafted = with_draft(stats, prep.draft(4).col_sums(4), 4)
        assert all(isinstance(s, DraftStats) for s in drafted)
        _same(policy.compress(drafted, prep.keys, prep.values, **args), plain)

    # and the served prefill does not draft at all
    def no_draft(*a, **k):
        raise AssertionError("lookahead 0 drafted")

    monkeypatch.setattr("vlkv.prefill_worker.engine.run_draft", no_draft)
    engine = PrefillEngine(cluster.model, ModelSpec.from_model(cluster.model, cluster.processor.tokenizer))
    ex, prep = examples[0], prepared[0]
    inputs = prepare_inputs(
        cluster.processor, ex.images, prompt_text(cluster.processor, ex), engine.spec.image_token_id
    )
    tensors = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}
    settings = CompressionSettings("vlcache", BUDGET, lookahead=0)
    req = PreparedRequest("la0", inputs.input_ids, tensors, inputs.modality, SamplingConfig(), settings)
    _same(engine.run(req).cache, compress(prep, "vlcache", BUDGET, lookahead=0))


def test_lookahead_changes_what_is_kept(setup):
    _, _, prepared = setup
    changed = [
        any(
            not torch.equal(x, y)
            for x, y in zip(
                compress(p, "vlcache", BUDGET, lookahead=0).kept_indices,
                compress(p, "vlcache", BUDGET, lookahead=6, lookahead_weight=1.0).kept_indices,
                strict=True,
            )
        )
        for p in prepared
    ]
    assert any(changed)


def test_draft_is_the_greedy_continuation(setup):
    cluster, examples, prepared = setup
    steps = 5
    for ex, prep in zip(examples, prepared, strict=True):
        draft = run_draft(cluster.model, prep.keys, prep.values, prep.first_token, steps, ())
        inputs = cluster.processor(
            images=ex.images, text=prompt_text(cluster.processor, ex), return_tensors="pt"
        )
        with torch.inference_mode():
            ref = cluster.model.generate(
                **inputs, max_new_tokens=steps + 1, do_sample=False, min_new_tokens=steps + 1
            )
        ref = ref[0, inputs["input_ids"].shape[1] :].tolist()
        assert [prep.first_token, *draft.tokens] == ref
        assert draft.inputs == ref[:steps] and draft.rows == steps
        assert draft.queries[0].shape[1] == steps and draft.keys[0].shape[1] == prep.m + steps
        # a shorter draft is the longer one's first rows, bit for bit
        short = run_draft(cluster.model, prep.keys, prep.values, prep.first_token, 2, ())
        for a, b in zip(short.col_sums(2), draft.col_sums(2), strict=True):
            assert torch.equal(a, b)


def test_draft_attention_is_each_rows_softmax_over_prompt_and_draft(setup):
    cluster, _, prepared = setup
    prep = prepared[1]
    draft = run_draft(cluster.model, prep.keys, prep.values, prep.first_token, 4, ())
    n, m = draft.rows, prep.m
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.cat(
        [torch.ones(n, m, dtype=torch.bool), causal], dim=1
    )  # row i sees the prompt, drafts <= i
    for q, k, got in zip(draft.queries, draft.keys, draft.col_sums(n), strict=True):
        k = k.float().repeat_interleave(q.shape[0] // k.shape[0], 0)
        logits = torch.einsum("hnd,hkd->hnk", q.float(), k) * draft.scale
        want = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).sum(1)[:, :m]
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def test_draft_stops_at_eos(setup):
    cluster, _, prepared = setup
    prep = prepared[0]
    assert run_draft(cluster.model, prep.keys, prep.values, prep.first_token, 4, {prep.first_token}).rows == 0
    for first in range(prep.first_token, prep.first_token + 20):  # a first token whose draft changes token
        full = run_draft(cluster.model, prep.keys, prep.values, first, 8, ())
        ends = [i for i, t in enumerate(full.tokens) if t != first and t not in full.tokens[:i]]
        if ends:
            break
    assert ends, "no draft of the tiny model changes token"
    stop = run_draft(cluster.model, prep.keys, prep.values, first, 8, {full.tokens[ends[0]]})
    assert stop.tokens == full.tokens[: ends[0] + 1] and stop.rows == ends[0] + 1


def test_served_prefill_equals_in_process_compress(setup):
    cluster, examples, prepared = setup
    engine = PrefillEngine(cluster.model, ModelSpec.from_model(cluster.model, cluster.processor.tokenizer))
    for ex, prep in zip(examples, prepared, strict=True):
        inputs = prepare_inputs(
            cluster.processor, ex.images, prompt_text(cluster.processor, ex), engine.spec.image_token_id
        )
        tensors = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}
        settings = CompressionSettings("vlcache", BUDGET, lookahead=6, lookahead_weight=0.5)
        req = PreparedRequest("la", inputs.input_ids, tensors, inputs.modality, SamplingConfig(), settings)
        served = engine.run(req).cache
        _same(served, compress(prep, "vlcache", BUDGET, lookahead=6, lookahead_weight=0.5))


def test_image_cache_reuse_path_drafts_too(setup):
    cluster, examples, _ = setup
    spec = ModelSpec.from_model(cluster.model, cluster.processor.tokenizer)
    engine = PrefillEngine(cluster.model, spec, image_cache=ImageCache(64 << 20))
    ex = examples[0]
    inputs = prepare_inputs(
        cluster.processor, ex.images, prompt_text(cluster.processor, ex), spec.image_token_id
    )
    tensors = {k: v for k, v in inputs.model_kwargs.items() if torch.is_tensor(v)}

    def run(lookahead: int):
        settings = CompressionSettings("vlcache", BUDGET, lookahead=lookahead, lookahead_weight=1.0)
        req = PreparedRequest("la", inputs.input_ids, tensors, inputs.modality, SamplingConfig(), settings)
        return engine.run(req)

    first = run(6)  # a miss: stores the image's K/V
    second = run(6)  # a hit: the reuse forward, then the draft over its keys
    assert second.reuse is not None and second.reuse.hit and not first.reuse.hit
    plain = run(0)
    assert second.cache.layer_lengths == plain.cache.layer_lengths
    assert any(
        not torch.equal(a, b)
        for a, b in zip(second.cache.kept_indices, plain.cache.kept_indices, strict=True)
    )


def test_request_with_lookahead_through_the_public_api(setup):
    cluster, examples, prepared = setup
    eos = cluster.processor.tokenizer.eos_token_id
    caches = [compress(p, "vlcache", BUDGET, lookahead=6, lookahead_weight=1.0) for p in prepared]
    outs = decode_batch(cluster.model, caches, 6, {eos})
    for ex, out in zip(examples, outs, strict=True):
        req = build_request(
            images=[png_bytes(i) for i in ex.images],
            question=ex.question,
            max_new_tokens=6,
            policy="vlcache",
            budget=BUDGET,
            lookahead=6,
            lookahead_weight=1.0,
        )
        served = generate(cluster.stub, req, timeout=60)
        assert served.token_ids == [t for t in out if t != eos]


def test_candidates_share_one_prompts_drafted_statistics_and_compress_as_with_fresh_ones(setup):
    """The evaluation tools hand every candidate the same drafted statistics objects (their per-layer draft
    gains computed once); each candidate's cache equals the one built from fresh objects."""
    _, _, prepared = setup
    prep = prepared[0]
    a = get_policy("vlcache", lookahead=4)
    b = get_policy("vlcache", lookahead=4, allocator={"name": "draft_mass", "weight": 1.0})
    shared = policy_stats(prep, a, BUDGET)
    assert policy_stats(prep, b, 0.5) is shared and all(isinstance(s, DraftStats) for s in shared)
    assert policy_stats(prep, get_policy("vlcache", lookahead=3), BUDGET) is not shared  # fewer draft rows
    q0 = a.query_start(prep.m, prep.tau, prep.question)
    for policy in (a, b):
        fresh = with_draft(prep.stats(q0, 0.01), *prep.draft_col_sums(4, 0.01))
        args = dict(
            alpha=BUDGET, m=prep.m, tau=prep.tau, first_token=prep.first_token, question=prep.question
        )
        _same(compress_with(prep, policy, BUDGET), policy.compress(fresh, prep.keys, prep.values, **args))
    assert all("gain" in s.__dict__ for s in shared)  # computed on the shared objects, once
