"""Image-KV reuse through the prefill engine: exactness on prefix hits and at ratio 1.0, rotated keys, the
work skipped by reused tokens, statistics and compression on the assembled cache, multi-image prompts."""

from __future__ import annotations

import pytest
import torch
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import language_model, load_model, load_processor
from vlkv.common.reuse import ReuseSettings
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.deploy.synthetic_task import make_examples
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.reuse_forward import rotate

FULL = CompressionSettings("full", 1.0, 0.01)
VLCACHE = CompressionSettings("vlcache", 0.5, 0.01)
PREFIXES = ["", "SYSTEM : the one is red . ", "SYSTEM : how many shapes , the circle two ? "]


@pytest.fixture(scope="module")
def default_engine():
    torch.set_num_threads(1)
    cfg = ModelConfig()
    model = load_model(cfg)
    return InProcessEngine(model, load_processor(cfg.path))


def prompt(example, prefix: str = "") -> str:
    return "<s> " + prefix + "USER :" + " <image>" * len(example.images) + f" {example.question} ASSISTANT :"


def cached(engine: InProcessEngine, mb: int = 64) -> PrefillEngine:
    return PrefillEngine(engine.model, engine.spec, ImageCache(mb << 20))


def tokens(engine: InProcessEngine, prefill: PrefillEngine, example, prefix, compression, reuse=None):
    """Greedy tokens of the whole pipeline with ``prefill`` as its prefill engine."""
    req = engine.prepare(example.images, prompt=prompt(example, prefix), compression=compression)
    if reuse is not None:
        req.reuse = reuse
    saved = engine.prefill
    engine.prefill = prefill
    try:
        return engine.generate_batch([req])[0].token_ids
    finally:
        engine.prefill = saved


@pytest.mark.parametrize("compression", [FULL, VLCACHE], ids=["full", "vlcache"])
def test_exact_prefix_hit_gives_the_same_greedy_tokens(default_engine, compression):
    eng = default_engine
    pe = cached(eng)
    for ex in make_examples(6, split="heldout"):
        want = tokens(eng, eng.prefill, ex, PREFIXES[1], compression)
        assert tokens(eng, pe, ex, PREFIXES[1], compression) == want  # miss: fills the cache
        hits = pe.image_cache.stats().hits
        assert tokens(eng, pe, ex, PREFIXES[1], compression) == want  # exact prefix hit
        assert pe.image_cache.stats().hits == hits + len(ex.images)


def test_exact_prefix_hit_recomputes_no_image_token(default_engine):
    eng = default_engine
    pe = cached(eng)
    ex = make_examples(1, split="heldout")[0]
    req = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[2]), compression=FULL)
    miss, hit = pe.run(req), pe.run(req)
    assert not miss.reuse.hit and hit.reuse.hit and hit.reuse.exact == len(ex.images)
    assert hit.reuse.recomputed_tokens == 0 and hit.reuse.ratio == 0
    assert miss.cache.first_token == hit.cache.first_token
    for a, b in zip(miss.cache.keys + miss.cache.values, hit.cache.keys + hit.cache.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["layerwise", "mpic"])
def test_hit_at_another_position_at_ratio_one_matches_no_cache(default_engine, mode):
    eng = default_engine
    pe = cached(eng)
    full_reuse = ReuseSettings(mode=mode, ratio=1.0)
    for ex in make_examples(6, split="heldout"):
        tokens(eng, pe, ex, PREFIXES[1], FULL)  # cached under one prefix
        for prefix in (PREFIXES[0], PREFIXES[2]):  # asked under others: the images move
            want = tokens(eng, eng.prefill, ex, prefix, FULL)
            assert tokens(eng, pe, ex, prefix, FULL, full_reuse) == want
            req = eng.prepare(ex.images, prompt=prompt(ex, prefix), compression=FULL)
            req.reuse = full_reuse
            got, ref = pe.run(req), eng.prefill.run(req)
            assert got.reuse.hit and got.reuse.exact == 0 and got.reuse.ratio == 1.0
            for a, b in zip(
                got.cache.keys + got.cache.values, ref.cache.keys + ref.cache.values, strict=True
            ):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_rotated_keys_match_keys_computed_at_the_new_position(default_engine):
    """Layer 0's keys of image tokens depend only on the image and the position: the cached keys rotated
    by the position difference must equal the keys a full forward computes at the new position."""
    eng = default_engine
    ex = make_examples(1, split="heldout")[0]
    a = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[0]), compression=FULL)
    b = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[2]), compression=FULL)
    (sa, ea), (sb, eb) = a.modality.vision_spans[0], b.modality.vision_spans[0]
    assert sb - sa > 5
    _, keys_a, _ = eng.prefill.forward(a)
    _, keys_b, _ = eng.prefill.forward(b)
    rope = language_model(eng.model).rotary_emb
    moved = rotate(keys_a[0][:, sa:ea], sb - sa, rope)
    torch.testing.assert_close(
        moved, keys_b[0][:, sb:eb], rtol=1e-4, atol=5e-5
    )  # fp32 rounding of two rotations
    assert (keys_a[0][:, sa:ea] - keys_b[0][:, sb:eb]).abs().max() > 1e-2  # the rotation did something


class RowRecorder:
    def __init__(self) -> None:
        self.rows: dict[int, int] = {}

    def observe(self, layer, query, key, scaling):
        self.rows[layer] = query.shape[2]
        assert key.shape[2] == self.m


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.5])
def test_reused_tokens_skip_the_layers_where_they_are_not_recomputed(default_engine, ratio):
    eng = default_engine
    pe = cached(eng)
    ex = make_examples(1, split="heldout")[0]
    pe.run(eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[1]), compression=FULL))
    req = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[2]), compression=FULL)
    req.reuse = ReuseSettings(mode="layerwise", ratio=ratio)
    rec = RowRecorder()
    rec.m = req.m
    logits, keys, values, report = pe.forward_cached(req, rec, q_start=req.m)
    n = req.modality.num_vision_tokens
    text = req.m - n
    ratios = report.layer_ratios
    assert report.hit and list(ratios) == sorted(ratios, reverse=True)
    expected = [text + -(-round(r * n, 6) // 1) for r in ratios]
    assert [rec.rows[i] for i in range(eng.spec.num_layers)] == [int(x) for x in expected]
    assert report.recomputed_tokens == int(expected[0]) - text
    assert abs(sum(ratios) / len(ratios) - ratio) <= 0.5 / (10 * len(ratios)) + 1e-9
    assert torch.isfinite(logits).all() and all(k.shape[1] == req.m for k in keys)


def test_statistics_and_compression_run_on_the_assembled_cache(default_engine):
    eng = default_engine
    pe = cached(eng)
    ex = make_examples(1, split="heldout")[0]
    compression = CompressionSettings("vlcache", 0.3, 0.01)
    pe.run(eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[1]), compression=compression))
    req = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[2]), compression=compression)
    req.reuse = ReuseSettings(mode="layerwise", ratio=0.1)
    res = pe.run(req)
    assert res.reuse.hit and res.policy == "vlcache"
    assert res.cache.prompt_length == req.m and res.cache.compression_ratio < 0.5


def test_policies_needing_queries_inside_the_image_do_not_reuse(default_engine):
    eng = default_engine
    pe = cached(eng)
    ex = make_examples(1, split="heldout")[0]
    h2o = CompressionSettings("h2o", 0.3, 0.01)
    req = eng.prepare(ex.images, prompt=prompt(ex, PREFIXES[1]), compression=h2o)
    first, second = pe.run(req), pe.run(req)
    ref = eng.prefill.run(req)
    assert not first.reuse.hit and not second.reuse.hit
    assert second.cache.first_token == ref.cache.first_token
    for a, b in zip(second.cache.keys, ref.cache.keys, strict=True):
        torch.testing.assert_close(a, b)


def test_reuse_off_neither_reads_nor_fills_the_cache(default_engine):
    eng = default_engine
    pe = cached(eng)
    ex = make_examples(1, split="heldout")[0]
    req = eng.prepare(ex.images, prompt=prompt(ex), compression=FULL)
    req.reuse = ReuseSettings(enabled=False)
    pe.run(req)
    assert len(pe.image_cache) == 0 and pe.image_cache.stats().misses == 0


def test_each_image_of_a_prompt_is_its_own_entry(default_engine):
    eng = default_engine
    pe = cached(eng)
    ex = next(e for e in make_examples(40, split="heldout") if len(e.images) == 2)
    tokens(eng, pe, ex, PREFIXES[1], FULL)
    assert len(pe.image_cache) == 2
    swapped = type(ex)(list(reversed(ex.images)), ex.question, ex.answer, ex.target, ex.category, ex.kind)
    want = tokens(eng, eng.prefill, swapped, PREFIXES[2], FULL)
    hits = pe.image_cache.stats().hits
    got = tokens(eng, pe, swapped, PREFIXES[2], FULL, ReuseSettings(ratio=1.0))
    assert pe.image_cache.stats().hits == hits + 2 and got == want


@pytest.mark.parametrize(
    "variant", ["llava-gqa", "llava-mha", "llava_next-gqa", "llava-qwen2", "llava-llama"]
)
def test_random_tiny_models_at_ratio_one_match_the_full_forward(tiny_model_dirs, variant):
    from PIL import Image

    path = tiny_model_dirs(variant)
    model = load_model(ModelConfig(path=path))
    eng = InProcessEngine(model, load_processor(path))
    pe = cached(eng)
    img = Image.new("RGB", (32, 32), (200, 30, 90))
    for text in ("<image> what colour", "the red one is <image> what shape is it", "a <image> b"):
        req = eng.prepare([img], prompt=text, compression=FULL)
        req.reuse = ReuseSettings(ratio=1.0)
        pe.run(req)  # fills (or, for the second and third prompt, hits at another position)
        got, ref = pe.run(req), eng.prefill.run(req)
        assert got.cache.first_token == ref.cache.first_token
        for a, b in zip(got.cache.keys + got.cache.values, ref.cache.keys + ref.cache.values, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (pe.reuser.unsupported == "") == variant.startswith("llava-")


def test_reuse_mode_old_name_is_an_alias():
    assert ReuseSettings(mode="vlcache").mode == "layerwise"
    with pytest.raises(ValueError, match="reuse mode"):
        ReuseSettings(mode="nope")
