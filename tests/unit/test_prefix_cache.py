"""The prefill worker's prefix cache in the prefill engine: a follow-up turn prefills only the tokens after the
cached prefix of its prompt, and a hit's cache equals the cold prefill's; a mismatched, corrupted or foreign block
is never used; another tenant's prefix is never hit; the cache stays within its bound under a burst. (Through
gRPC: tests/integration/test_prefix_cache_served.py.)"""

from __future__ import annotations

import pytest
import torch
from conversations import FULL, VLCACHE, png, prefill, prompts
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.common.prefix_key import block_keys, image_starts, prefix_seed
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    cfg = ModelConfig()
    return InProcessEngine(load_model(cfg), load_processor(cfg.path))


def test_prefix_hit_equals_the_cold_prefill(engine):
    """Compressed too: a hit's K/V, first token and kept cache equal the cold prefill's."""
    img = [png(3)]
    for compression in (FULL, VLCACHE):
        pe = prefill(engine)
        pe.run(engine.prepare(img, prompt=prompts(1), compression=compression))
        req = engine.prepare(img, prompt=prompts(2), compression=compression)
        hit = pe.run(req)
        cold = engine.prefill.run(req)
        assert hit.prefix.cached_tokens > 0
        assert hit.cache.first_token == cold.cache.first_token
        assert hit.cache.layer_lengths == cold.cache.layer_lengths
        for a, b in zip(hit.cache.keys + hit.cache.values, cold.cache.keys + cold.cache.values, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_another_tenant_never_hits_unless_shared(engine):
    img = [png(4)]
    for share, hits in ((False, 0), (True, 1)):
        pe = prefill(engine, share=share)
        first = engine.prepare(img, prompt=prompts(1), compression=FULL)
        first.tenant = "alice"
        pe.run(first)
        other = engine.prepare(img, prompt=prompts(2), compression=FULL)
        other.tenant = "bob"
        got = pe.run(other)
        assert (got.prefix.cached_tokens > 0) == bool(hits), share
        assert pe.prefixes.cache.stats().hits == hits


def test_another_image_is_a_miss(engine):
    pe = prefill(engine)
    pe.run(engine.prepare([png(5)], prompt=prompts(1), compression=FULL))
    got = pe.run(engine.prepare([png(6)], prompt=prompts(2), compression=FULL))
    ids = engine.prepare([png(6)], prompt=prompts(2), compression=FULL).input_ids.reshape(-1)
    first_image = int((ids == engine.spec.image_token_id).nonzero()[0])
    assert got.prefix.cached_tokens <= first_image  # only the text before the image can match


def test_a_corrupted_block_is_dropped_never_served(engine):
    img = [png(7)]
    pe = prefill(engine)
    pe.run(engine.prepare(img, prompt=prompts(1), compression=FULL))
    cache = pe.prefixes.cache
    req = engine.prepare(img, prompt=prompts(2), compression=FULL)
    key = pe.prefixes.keys_of(req)[0][0]  # the chain's first block
    cache._blocks[key].keys[0, 0, 0, 0] = float("nan")
    got = pe.run(req)
    assert got.prefix.cached_tokens == 0 and cache.stats().rejected == 1
    cold = engine.prefill.run(req)
    assert got.cache.first_token == cold.cache.first_token


def test_a_block_whose_ids_differ_is_not_used(engine):
    """A forged key (a block stored under another prompt's key) fails the ids check."""
    img = [png(8)]
    pe = prefill(engine)
    pe.run(engine.prepare(img, prompt=prompts(1), compression=FULL))
    cache = pe.prefixes.cache
    req = engine.prepare(
        img, prompt="<s> SYSTEM : be brief . USER : <image> hello ? ASSISTANT :", compression=FULL
    )
    keys, _ = pe.prefixes.keys_of(req)
    stolen = next(iter(cache._blocks.values()))
    cache._blocks[keys[0]] = stolen  # the other prompt's first block, filed under this prompt's key
    cache._bytes += stolen.nbytes
    got = pe.run(req)
    assert got.prefix.cached_tokens == 0 and cache.stats().rejected == 1


def test_a_burst_stays_within_the_bound_and_every_request_is_served(engine):
    per_block = 2 * engine.spec.num_layers * engine.spec.num_kv_heads * 4 * engine.spec.head_dim * 4
    cap = per_block * 10  # ten blocks: far fewer than the burst's prompts hold
    pe = PrefillEngine(engine.model, engine.spec, None, prefix_cache=PrefixCache(cap, 4))
    for i in range(8):
        res = pe.run(engine.prepare([png(100 + i)], prompt=prompts(1 + i % 3), compression=VLCACHE))
        assert res.cache.first_token >= 0
        s = pe.prefixes.cache.stats()
        assert s.bytes_held <= cap and s.blocks <= 10
    assert pe.prefixes.cache.stats().evictions > 0


def test_block_keys_chain_and_seed():
    ids = list(range(40))
    seed = prefix_seed("fp", "t", 8)
    a = block_keys(ids, ["d1"], [9], seed, 8)
    assert len(a) == 5
    b = block_keys(ids[:20] + [99] + ids[21:], ["d1"], [9], seed, 8)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # a change ends the match from its block on
    assert block_keys(ids, ["d2"], [9], seed, 8)[0] == a[0]  # the image starts in block 1
    assert block_keys(ids, ["d2"], [9], seed, 8)[1] != a[1]
    assert block_keys(ids, ["d1"], [9], prefix_seed("fp", "u", 8), 8)[0] != a[0]
    assert block_keys(ids, ["d1"], [9], prefix_seed("fp2", "t", 8), 8)[0] != a[0]
    assert image_starts([1, 5, 5, 2, 5, 5], 5, [2, 2], 2) == [1, 4]
    assert image_starts([1, 5, 5, 5, 5, 2], 5, [], 2) == [1, 1]  # one run for two images: both at its start


@pytest.mark.parametrize("variant", ["llava-qwen2", "llava_next-qwen2", "llava-mistral-w8", "llava-gemma3"])
def test_prefix_hit_equals_the_cold_prefill_on_every_family(tiny_model_dirs, variant):
    """The suffix runs through the model's own forward over the cached K/V: per-layer-type rotary
    embeddings and sliding-window masks included (the history is longer than the windows)."""
    path = tiny_model_dirs(variant)
    eng = InProcessEngine(load_model(ModelConfig(path=path)), load_processor(path))
    img = [png(30)]
    pe = prefill(eng)
    for turns in (1, 2):
        req = eng.prepare(img, prompt=prompts(turns).replace("<s> ", ""), compression=FULL)
        hit, cold = pe.run(req), eng.prefill.run(req)
        assert (hit.prefix.cached_tokens > 0) == (turns == 2), variant
        assert hit.cache.first_token == cold.cache.first_token
        for a, b in zip(hit.cache.keys + hit.cache.values, cold.cache.keys + cold.cache.values, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
