"""Decoder families beyond Llama (``common/model/families.py``), served end to end through gRPC.

Random tiny LLaVA checkpoints whose decoder is Llama, Qwen2 (LLaVA and LLaVA-NeXT), Mistral with a window
longer than the prompt and one shorter, Qwen2 with sliding layers, and Gemma 3 (two sliding layers, one
global; q/k norms, per-layer-type rotary embeddings, embedding scale). With compression off the served greedy
tokens equal ``model.generate()``, prompts longer than the window included; at 10% a request decodes and a
sliding layer keeps at most the positions its window reads. A family vlkv has no entry for is refused when its
spec is built, which the gateway and both workers do at start-up.
"""

from __future__ import annotations

import pytest
from generate_reference import MAX_NEW, reference_tokens
from inproc_cluster import InProcCluster
from sample_images import random_png
from tiny_models import DECODER_VARIANTS
from transformers import Gemma3TextConfig, LlavaConfig, Phi3Config
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig, TransferConfig
from vlkv.common.errors import ConfigError
from vlkv.common.model.families import sliding_windows
from vlkv.common.model.spec import ModelSpec
from vlkv.deploy.client import build_request, generate

SHORT = "what colour is the square ?"
LONG = "what colour shape is the square circle triangle red blue green it a there are one two ? " * 2


@pytest.fixture(scope="module", params=list(DECODER_VARIANTS))
def cluster(request, tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs(request.param)),
        pool=PoolConfig(pool_bytes=8 << 20),
        transfer=TransferConfig(kv_transport="grpc"),
    )
    cluster = InProcCluster(cfg)
    cluster.variant = request.param
    yield cluster
    cluster.close()


def test_full_cache_tokens_equal_generate(cluster):
    windows = sliding_windows(cluster.model.config.text_config)
    free_before = cluster.pool.num_free
    for seed, question in ((1, SHORT), (2, LONG)):
        images = [random_png(seed)]
        req = build_request(images=images, question=question, max_new_tokens=MAX_NEW, policy="full")
        got = generate(cluster.stub, req, timeout=60)
        want = reference_tokens(cluster, images, question)
        assert got.token_ids == want, f"{cluster.variant}: {question!r} (windows {windows})"
        assert question == SHORT or got.finished.usage.prompt_tokens > 8  # longer than the short windows
    assert cluster.pool.num_free == free_before


def test_compressed_request_decodes_and_sliding_layers_keep_their_window(cluster):
    windows = sliding_windows(cluster.model.config.text_config)
    req = build_request(
        images=[random_png(3)], question=LONG, max_new_tokens=MAX_NEW, policy="vlcache", budget=0.1
    )
    got = generate(cluster.stub, req, timeout=60)
    usage = got.finished.usage
    assert usage.generated_tokens >= 1
    assert 0 < usage.kv_bytes_kept < usage.kv_bytes_full
    kept = list(usage.layer_budgets)
    assert len(kept) == len(windows)
    per_token_layer = usage.kv_bytes_full // (len(kept) * usage.prompt_tokens)
    assert usage.kv_bytes_kept == sum(kept) * per_token_layer  # the bytes are the kept lengths' accounting
    for layer, (k, w) in enumerate(zip(kept, windows, strict=True)):
        assert 1 <= k <= usage.prompt_tokens
        if w:
            assert k <= w - 1, f"{cluster.variant}: layer {layer} keeps {k} with window {w}"


def test_full_cache_sliding_layers_keep_only_their_window(cluster):
    windows = sliding_windows(cluster.model.config.text_config)
    req = build_request(images=[random_png(4)], question=LONG, max_new_tokens=2, policy="full")
    usage = generate(cluster.stub, req, timeout=60).finished.usage
    m = usage.prompt_tokens
    assert list(usage.layer_budgets) == [min(m, w - 1) if w else m for w in windows]
    # the bytes the windows kept out: every sliding layer's positions before its reach
    per_token_layer = usage.kv_bytes_full // (len(windows) * m)
    assert usage.kv_bytes_window_saved == per_token_layer * sum(m - min(m, w - 1) for w in windows if w)
    assert usage.kv_bytes_kept + usage.kv_bytes_window_saved == usage.kv_bytes_full


def test_a_verified_request_runs_its_candidates_on_every_family(cluster):
    """No policy named: the verifier's candidates compress, are teacher-forced and one is handed over."""
    windows = sliding_windows(cluster.model.config.text_config)
    req = build_request(images=[random_png(5)], question=LONG, max_new_tokens=MAX_NEW, budget=0.1)
    usage = generate(cluster.stub, req, timeout=60).finished.usage
    assert usage.verify == "floor" and usage.verified_candidate and usage.draft_tokens > 0
    assert usage.generated_tokens >= 1
    for k, w in zip(usage.layer_budgets, windows, strict=True):
        assert not w or k <= w - 1


def _llava_config(text) -> LlavaConfig:
    return LlavaConfig(text_config=text, image_token_index=3)


def test_unsupported_family_is_refused_with_its_name():
    text = Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=40)
    with pytest.raises(
        ConfigError, match="'phi3' is not supported.*supported: gemma3_text, llama, mistral, qwen2"
    ):
        ModelSpec.from_config(_llava_config(text), dtype=None, eos_token_ids=())


def test_gemma3_with_logit_softcapping_is_refused_naming_what_is_missing():
    text = Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=40, attn_logit_softcapping=50.0
    )
    with pytest.raises(ConfigError, match="'gemma3_text'.*attn_logit_softcapping"):
        ModelSpec.from_config(_llava_config(text), dtype=None, eos_token_ids=())


def test_windows_per_family():
    gemma = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    assert sliding_windows(gemma) == (512,) * 5 + (0,)


@pytest.mark.parametrize("variant", ["llava-gemma3", "llava-mistral-w8", "llava-qwen2"])
def test_teacher_forcing_equals_the_models_own_steps(tiny_model_dirs, variant):
    """``forced_logprobs`` over the full cache (sliding layers cut to their window) gives the next-token
    distributions of the model's own greedy steps, past the point where the window drops prompt tokens."""
    import io

    import torch
    from PIL import Image
    from vlkv.common.compression.registry import CompressionSettings
    from vlkv.common.model.loading import load_model, load_processor
    from vlkv.common.sampling import SamplingConfig
    from vlkv.deploy.inprocess import InProcessEngine
    from vlkv.prefill_worker.teacher_force import forced_logprobs

    path = tiny_model_dirs(variant)
    model, proc = load_model(ModelConfig(path=path)), load_processor(path)
    engine = InProcessEngine(model, proc, pool_bytes=8 << 20)
    images = [random_png(7)]
    prepared = engine.prepare(
        images,
        question=LONG,
        sampling=SamplingConfig(max_new_tokens=12),
        compression=CompressionSettings("full"),
    )
    cache = engine.prefill.run(prepared).cache
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LONG}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(images=[Image.open(io.BytesIO(images[0])).convert("RGB")], text=text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert tokens[0] == cache.first_token
    want = torch.log_softmax(torch.cat(out.logits[1:]).float(), -1)  # after feeding tokens[: g + 1]
    ((_, got),) = forced_logprobs(model, [cache], [tokens[:-1]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_window_the_request_cannot_outgrow_does_not_bind():
    """Mistral's 4K window over a 2K prompt and 64 new tokens cuts nothing: compressed as a full layer."""
    from vlkv.common.compression.windows import binding_windows

    assert binding_windows((4096,) * 3, 2048, 64) == ()
    assert binding_windows((0, 64, 8), 50, 10) == (0, 0, 8)
    assert binding_windows((0, 64, 8), 50, 14) == (0, 0, 8)  # position 63 still reads position 0
    assert binding_windows((0, 64, 8), 50, 15) == (0, 64, 8)
    assert binding_windows((), 50, 10) == ()


def test_a_sliding_window_cache_over_nixl_decodes_as_over_grpc(tiny_model_dirs):
    """The hand-off is the same CompactKV whatever the family: Gemma 3's windowed caches over NIXL (``nixl``
    alone: a cache NIXL could not carry fails the request, it is not sent over gRPC)."""
    from vlkv.common.handoff.nixl_agent import nixl_available

    if nixl_available():
        pytest.skip(nixl_available())
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gemma3")),
        pool=PoolConfig(pool_bytes=8 << 20),
        transfer=TransferConfig(kv_transport="nixl", nixl_min_bytes=0),
    )
    cluster = InProcCluster(cfg)
    try:
        images = [random_png(7)]
        req = build_request(images=images, question=LONG, max_new_tokens=MAX_NEW, policy="full")
        assert generate(cluster.stub, req, timeout=60).token_ids == reference_tokens(cluster, images, LONG)
        req = build_request(images=images, question=LONG, max_new_tokens=MAX_NEW, budget=0.1)
        assert generate(cluster.stub, req, timeout=60).finished.usage.generated_tokens >= 1
    finally:
        cluster.close()
