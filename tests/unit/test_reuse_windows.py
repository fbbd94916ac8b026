"""Image-KV reuse and decode-phase re-compression on windowed decoders (Mistral with a binding window, Qwen2 with
sliding layers, Gemma 3 with sliding and global layers).

Random tiny LLaVA checkpoints (``tests/tiny_models.py``'s ``DECODER_VARIANTS``, windows of 8 over prompts of ~60
tokens): an exact-prefix image hit recomputes nothing and gives ``model.generate()``'s greedy tokens; a hit at
another position recomputing everything gives the fresh forward's K/V in every layer, and one recomputing
nothing gives layer 0's image keys at the new position (cached keys rotated by each layer's own rope);
``rotate`` equals the model's own RoPE at the new position per layer type. With ``--decode-budget`` a sliding
layer's ring is never re-compressed while a global layer is, and a window the request cannot outgrow is
re-compressed like a full-attention layer.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from sample_images import random_png
from vlkv.common.compression.registry import CompressionSettings
from vlkv.common.config import ModelConfig
from vlkv.common.model.families import family_of
from vlkv.common.model.loading import language_model, load_model, load_processor
from vlkv.common.reuse import ReuseSettings
from vlkv.common.sampling import SamplingConfig
from vlkv.deploy.inprocess import InProcessEngine
from vlkv.prefill_worker.engine import PrefillEngine
from vlkv.prefill_worker.image_cache import ImageCache
from vlkv.prefill_worker.reuse_forward import reuse_supported, rotate

WINDOWED = ["llava-mistral-w8", "llava-qwen2-w8", "llava-gemma3"]
FULL = CompressionSettings("full")
LONG = "what colour shape is the square circle triangle red blue green it a there are one two ? " * 2
NEW = 12


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request, tiny_model_dirs):
    torch.set_num_threads(1)
    path = tiny_model_dirs(request.param)
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    eng = InProcessEngine(model, proc, pool_bytes=8 << 20)
    eng.variant = request.param
    return eng


def cached(eng: InProcessEngine) -> PrefillEngine:
    return PrefillEngine(eng.model, eng.spec, ImageCache(64 << 20))


def generate_reference(eng: InProcessEngine, image: bytes, question: str) -> list[int]:
    proc = eng.processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(images=[Image.open(io.BytesIO(image)).convert("RGB")], text=text, return_tensors="pt")
    with torch.inference_mode():
        out = eng.model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    eos = proc.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids  # the served tokens end before an EOS


def served_tokens(eng: InProcessEngine, prefill: PrefillEngine, req) -> list[int]:
    saved, eng.prefill = eng.prefill, prefill
    try:
        return eng.generate_batch([req])[0].token_ids
    finally:
        eng.prefill = saved


def test_windowed_families_reuse(windowed):
    assert reuse_supported(windowed.model) == ""
    assert any(windowed.spec.windows)


def test_exact_prefix_hit_gives_generates_tokens(windowed):
    eng = windowed
    image = random_png(11)
    req = eng.prepare([image], question=LONG, sampling=SamplingConfig(max_new_tokens=NEW), compression=FULL)
    assert req.m > 4 * max(eng.spec.windows)  # the prompt outgrows the window
    want = generate_reference(eng, image, LONG)
    pe = cached(eng)
    miss, hit = pe.run(req), pe.run(req)
    assert not miss.reuse.hit and hit.reuse.hit and hit.reuse.exact == 1
    assert hit.reuse.recomputed_tokens == 0 and hit.reuse.ratio == 0
    assert hit.cache.first_token == want[0]
    for a, b in zip(hit.cache.keys + hit.cache.values, miss.cache.keys + miss.cache.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    hits = pe.image_cache.stats().hits
    assert served_tokens(eng, pe, req) == want  # through the prefill engine's hit and the paged decode
    assert pe.image_cache.stats().hits == hits + 1


def _shifted(eng: InProcessEngine, ratio: float, mode: str = "layerwise"):
    """A hit at another position than the image was cached at: the reuse forward's and a fresh forward's
    ``(keys, values)`` (every layer's whole prompt) and the image span now."""
    pe = cached(eng)
    img = Image.new("RGB", (32, 32), (200, 30, 90))
    pe.run(eng.prepare([img], prompt="<image> what colour is it", compression=FULL))  # fills
    text = "the red one is there a big one is <image> what shape is it and what colour"
    req = eng.prepare([img], prompt=text, compression=FULL)
    req.reuse = ReuseSettings(mode=mode, ratio=ratio)
    _, keys, values, report = pe.forward_cached(req, None, q_start=req.m)
    assert report.hit and report.exact == 0
    _, ref_keys, ref_values = eng.prefill.forward(req)
    ((start, end),) = req.modality.vision_spans
    assert start > max(eng.spec.windows)  # the image moved by more than a window
    return keys, values, ref_keys, ref_values, (start, end), req, report, pe


def test_hit_at_another_position_recomputing_everything_is_the_fresh_forward(windowed):
    keys, values, ref_keys, ref_values, _, req, report, pe = _shifted(windowed, 1.0)
    assert report.ratio == 1.0
    for a, b in zip(keys + values, ref_keys + ref_values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    got, ref = pe.run(req), windowed.prefill.run(req)  # compressed to the windows as a miss would be
    assert got.reuse.hit and got.cache.first_token == ref.cache.first_token
    for a, b in zip(got.cache.keys + got.cache.values, ref.cache.keys + ref.cache.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hit_recomputing_nothing_rotates_layer_zeros_image_keys_to_the_new_position(windowed):
    """Layer 0's keys of the image depend on its features and position only: the cached keys rotated by the
    layer's own rope equal the fresh forward's; the values are the cached ones unchanged."""
    keys, values, ref_keys, ref_values, (s, e), _, report, _ = _shifted(windowed, 0.0)
    assert report.recomputed_tokens == 0
    torch.testing.assert_close(keys[0][:, s:e], ref_keys[0][:, s:e], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(values[0][:, s:e], ref_values[0][:, s:e], rtol=1e-4, atol=1e-5)
    # the text after the image reads it through the layer's own (windowed) mask: its keys match in layer 0 too
    torch.testing.assert_close(keys[0][:, e:], ref_keys[0][:, e:], rtol=1e-4, atol=1e-5)


def test_rotate_equals_the_models_own_rope_per_layer_type(windowed):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = language_model(windowed.model)
    ropes = family_of(lm.config).layer_ropes(lm)
    torch.manual_seed(0)
    head_dim = windowed.spec.head_dim
    raw = torch.randn(1, 2, 5, head_dim)
    at = torch.arange(3, 8)[None]
    for rope in ropes:
        cos, sin = rope(raw, at)
        cos2, sin2 = rope(raw, at + 40)
        _, k = apply_rotary_pos_emb(raw, raw, cos, sin)
        _, want = apply_rotary_pos_emb(raw, raw, cos2, sin2)
        torch.testing.assert_close(rotate(k, 40, rope), want, rtol=1e-4, atol=1e-5)
    if windowed.variant == "llava-gemma3":  # local and global layers rotate differently: the type matters
        local, glob = ropes[0], ropes[-1]
        assert (local.layer_type, glob.layer_type) == ("sliding_attention", "full_attention")
        _, k = apply_rotary_pos_emb(raw, raw, *local(raw, at))
        assert (rotate(k, 40, local) - rotate(k, 40, glob)).abs().max() > 1e-2


# -- decode-phase re-compression ---------------------------------------------------------------------------


def _decode_run(model, proc, budget: float, caches, tokens=None, window: int = 2):
    """Per step, each layer's cached K of the one sequence (``[H_kv, n, D]``); teacher-forced to ``tokens``."""
    eng = InProcessEngine(
        model, proc, pool_bytes=4 << 20, block_size=4, decode_budget=budget, decode_window=window
    )
    steps = []
    real_post = eng.core.postprocess

    def post(batch, logits):
        out = real_post(batch, logits)
        for s in batch:
            if not s.finished:
                steps.append(
                    [eng.cache.read(t, n)[0].clone() for t, n in zip(s.blocks.tables, s.lengths, strict=True)]
                )
        return out

    eng.core.postprocess = post
    if tokens is None:
        out = eng.decode_caches(caches, SamplingConfig(max_new_tokens=30), ())
    else:
        out = eng.teacher_force(caches, len(tokens[0]), tokens)
    return out[0], steps, eng.core


def test_decode_recompression_leaves_sliding_rings_intact(tiny_model_dirs):
    """Gemma 3 (two sliding layers, then a global one): with re-compression on, the global layer is cut back
    while the sliding layers hold exactly what they hold without it, step by step (same tokens forced)."""
    path = tiny_model_dirs("llava-gemma3")
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    base = InProcessEngine(model, proc, pool_bytes=4 << 20)
    req = base.prepare(
        [random_png(5)], question=LONG, sampling=SamplingConfig(max_new_tokens=30), compression=FULL
    )
    cache = base.prefill.run(req).cache
    windows = base.spec.windows
    assert windows[:2] != (0, 0) and windows[-1] == 0
    tokens, off, _ = _decode_run(model, proc, 0.0, [cache])
    # 10% + 2 recent: a ring of 7-10 entries would be cut too (trigger: ceil(0.1 * 7) + 2 + a block of 4)
    _, on, core = _decode_run(model, proc, 0.1, [cache], [tokens])
    assert core.evicted_tokens > 0 and core.slid_tokens > 0
    assert len(on) == len(off)
    cut = False
    for a, b in zip(on, off, strict=True):
        for layer, w in enumerate(windows):
            if w:
                assert a[layer].shape == b[layer].shape and a[layer].shape[1] < w + 4 - 1  # a ring
                torch.testing.assert_close(a[layer], b[layer])
        cut |= a[-1].shape[1] < b[-1].shape[1]
    assert cut  # the global layer was re-compressed


def test_a_window_the_request_cannot_outgrow_is_recompressed_like_a_full_layer(tiny_model_dirs):
    """Mistral's window of 64 over a ~25-token prompt and 30 new tokens binds nothing: the prefill compressed it
    by score, and decode re-compression cuts it like any full-attention layer; with 60 new tokens it binds and
    every layer is a ring: nothing is re-compressed."""
    path = tiny_model_dirs("llava-mistral-w64")
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    base = InProcessEngine(model, proc, pool_bytes=4 << 20)

    def run(new: int):
        req = base.prepare(
            [random_png(6)],
            question="what colour ?",
            sampling=SamplingConfig(max_new_tokens=new),
            compression=FULL,
        )
        cache = base.prefill.run(req).cache
        eng = InProcessEngine(
            model, proc, pool_bytes=4 << 20, block_size=4, decode_budget=0.3, decode_window=4
        )
        out = eng.decode_caches([cache], SamplingConfig(max_new_tokens=new), ())
        return req.m, len(out[0]), eng.core

    m, n, core = run(30)
    assert m + 30 <= 64 and n == 30 and core.evicted_tokens > 0 and core.slid_tokens == 0
    m, n, core = run(60)
    assert m + 60 > 64 and n == 60 and core.evicted_tokens == 0 and core.slid_tokens > 0


def test_a_layer_types_rope_that_is_not_a_rotation_is_refused_naming_it():
    """Gemma 3 with dynamic NTK on its global layers: the local layers could reuse, the global ones cannot (a
    cached key is not moved by a rotation), so the image cache is off, saying which layers and why."""
    from transformers import CLIPVisionConfig, Gemma3TextConfig, LlavaConfig, LlavaForConditionalGeneration

    ropes = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
    }
    text = Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=40,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=ropes,
    )
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    model = LlavaForConditionalGeneration(
        LlavaConfig(text_config=text, vision_config=vision, image_token_index=3)
    )
    assert reuse_supported(model) == "rope type 'dynamic' (full_attention layers) is not a pure rotation"
    ropes["full_attention"] = {
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }  # Gemma 3 4B's: a rotation
    text.rope_parameters = ropes
    assert (
        reuse_supported(LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision)))
        == ""
    )
