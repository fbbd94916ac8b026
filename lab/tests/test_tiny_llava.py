"""Tiny offline LLaVA / LLaVA-NeXT builders: tokenizer, processor, config, generate."""

import pytest
import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
)
from vlkv_lab.task.tiny_llava import (
    IMAGE,
    SPECIAL_TOKENS,
    build_processor,
    build_tiny,
    build_tokenizer,
    tiny_llava_config,
    tokens_per_image,
)

WORDS = "what colour is the square circle red blue it a".split()


def _messages(n_images: int, question: str = "what colour is the square ?"):
    return [
        {
            "role": "user",
            "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}],
        }
    ]


def test_tokenizer_special_ids_and_roundtrip():
    tok = build_tokenizer(WORDS)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.pad_token_id == 0 and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.unk_token == "<unk>"
    ids = tok("what colour is the square ?", add_special_tokens=True).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == "what colour is the square ?"
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == (
        "what colour is the square ?"
    )
    # <image> stays one token even when glued to neighbours (processor expands it that way).
    assert tok("<image><image> what").input_ids == [4, 4, tok.convert_tokens_to_ids("what")]


def test_chat_template_rendering():
    tok = build_tokenizer(WORDS)
    text = tok.apply_chat_template(_messages(1), add_generation_prompt=True, tokenize=False)
    assert text == "<s> USER : <image> what colour is the square ? ASSISTANT :"
    text2 = tok.apply_chat_template(_messages(2), add_generation_prompt=True, tokenize=False)
    assert text2 == "<s> USER : <image> <image> what colour is the square ? ASSISTANT :"
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "what is it ?"}, {"role": "assistant", "content": "it is red ."}],
        tokenize=False,
    )
    assert plain == "<s> USER : what is it ? ASSISTANT : it is red . </s>"
    assert tok.unk_token_id not in tok(text).input_ids


@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_processor_and_config_agree(kind):
    tok = build_tokenizer(WORDS)
    proc = build_processor(tok, image_size=32, patch_size=8, kind=kind)
    assert isinstance(proc, LlavaProcessor if kind == "llava" else LlavaNextProcessor)
    cfg = tiny_llava_config(
        vocab_size=len(tok),
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        kind=kind,
        image_size=32,
        patch_size=8,
    )
    assert cfg.image_token_id == tok.convert_tokens_to_ids(IMAGE) == proc.image_token_id
    assert cfg.vision_feature_select_strategy == "default"
    text = proc.apply_chat_template(_messages(1), add_generation_prompt=True)
    inputs = proc(images=[Image.new("RGB", (32, 32), (255, 0, 0))], text=text, return_tensors="pt")
    n_img = int((inputs["input_ids"] == cfg.image_token_id).sum())
    if kind == "llava":
        assert n_img == tokens_per_image(32, 8) == 16
    else:
        assert n_img > tokens_per_image(32, 8)


@pytest.mark.parametrize("kind", ["llava", "llava_next"])
@pytest.mark.parametrize("num_kv_heads", [2, 4])  # GQA and MHA
@pytest.mark.parametrize("n_images", [1, 2])
def test_random_model_generates(kind, num_kv_heads, n_images):
    image_size, patch_size = (96, 12) if kind == "llava" else (32, 8)
    tok, proc, cfg = build_tiny(
        WORDS, kind=kind, image_size=image_size, patch_size=patch_size, num_kv_heads=num_kv_heads, layers=2
    )
    assert cfg.text_config.num_key_value_heads == num_kv_heads
    torch.manual_seed(0)
    cls = LlavaForConditionalGeneration if kind == "llava" else LlavaNextForConditionalGeneration
    model = cls(cfg).eval()
    text = proc.apply_chat_template(_messages(n_images), add_generation_prompt=True)
    images = [Image.new("RGB", (image_size + 8 * i, image_size), (40 * i, 200, 10)) for i in range(n_images)]
    inputs = proc(images=images, text=text, return_tensors="pt")
    if kind == "llava":
        assert int((inputs["input_ids"] == cfg.image_token_id).sum()) == n_images * 64
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 5
    assert torch.equal(out[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])


def test_save_and_reload(tmp_path):
    tok, proc, cfg = build_tiny(WORDS, layers=2)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    proc2 = AutoProcessor.from_pretrained(tmp_path)
    model2 = LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert proc2.chat_template == proc.chat_template
    assert model2.config.image_token_id == cfg.image_token_id
    text = proc2.apply_chat_template(_messages(1), add_generation_prompt=True)
    img = [Image.new("RGB", (96, 96), (0, 0, 255))]
    a = proc(images=img, text=text, return_tensors="pt")
    b = proc2(images=img, text=text, return_tensors="pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(model(**a).logits, model2(**b).logits)


def test_chat_template_writes_a_default_system_prompt_only_when_the_chat_has_none():
    from vlkv_lab.task.tiny_llava import build_tokenizer

    tok = build_tokenizer(["what", "is", "it", "look"], system_prompt="look at it .")
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it ?"}]}]
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == "<s> SYSTEM : look at it . USER : <image> what is it ? ASSISTANT :"
    own = [{"role": "system", "content": "it is"}, *user]
    text = tok.apply_chat_template(own, tokenize=False, add_generation_prompt=True)
    assert text.count("SYSTEM") == 1 and "look at it" not in text
    plain = build_tokenizer(["what"]).apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert "SYSTEM" not in plain
    with pytest.raises(ValueError):
        build_tokenizer(["what"], system_prompt="{{ evil }}")
