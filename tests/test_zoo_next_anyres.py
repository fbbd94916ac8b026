"""Zoo member next_anyres: its task generator, scoring, and the shipped LLaVA-NeXT checkpoint served through
the product's own loading path and the public API."""

from __future__ import annotations

import io

import pytest
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv.tools.client import build_request, generate
from vlkv.tools.zoo import member, next_anyres
from vlkv.tools.zoo.next_scenes import content_words, generate_answer, is_correct

from tests.inproc_cluster import InProcCluster

M = next_anyres


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_member_interface():
    mod = member("next_anyres")
    for name in (
        "NAME",
        "MODEL_DIR",
        "MAX_NEW_TOKENS",
        "GEOMETRY",
        "make_examples",
        "is_correct",
        "prompt_text",
    ):
        assert hasattr(mod, name), name


def test_examples_are_deterministic_and_splits_disjoint():
    a, b = M.make_examples(6, seed=3, split="train"), M.make_examples(6, seed=3, split="train")
    assert [(x.images[0].tobytes(), x.answer) for x in a] == [(x.images[0].tobytes(), x.answer) for x in b]
    held = M.make_examples(6, seed=3, split="heldout")
    assert {x.images[0].tobytes() for x in a}.isdisjoint({x.images[0].tobytes() for x in held})
    with pytest.raises(ValueError):
        M.make_examples(1, split="test")


def test_questions_are_keyed_by_a_unique_shape_and_answered_after_the_first_token():
    for ex in M.make_examples(30, seed=0):
        assert ex.images[0].size in ((672, 336), (336, 672))
        shape = ex.question.split()[4]
        assert [o.shape for o in ex.objects[0]].count(shape) == 1
        ((_, obj),) = ex.focus
        assert ex.answer == f"the {shape} {obj.colour} ." and ex.target == obj.colour


def test_scoring_reads_shape_and_colour_words_in_order():
    ex = M.make_examples(1)[0]
    shape, colour = content_words(ex.answer)
    wrong = next(c for c in ("red", "green", "blue", "yellow", "purple") if c != colour)
    assert is_correct(ex.answer, ex) and is_correct(f"the {shape} {colour} . </s> the red", ex)
    assert not is_correct(f"the {shape} {wrong} .", ex) and not is_correct("the .", ex)


def test_shipped_checkpoint_is_llava_next_with_1500_plus_vision_tokens_and_answers():
    model = load_model(ModelConfig(path=str(M.MODEL_DIR)))
    processor = load_processor(str(M.MODEL_DIR))
    assert type(model).__name__ == "LlavaNextForConditionalGeneration"
    assert sum(f.stat().st_size for f in M.MODEL_DIR.iterdir()) < 10e6
    ex = M.make_examples(1, seed=0)[0]
    ids = processor(images=ex.images, text=M.prompt_text(processor, ex), return_tensors="pt")["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) >= 1500
    assert is_correct(generate_answer(model, processor, ex, M.MAX_NEW_TOKENS), ex)


def test_served_through_the_public_api():
    cfg = ServerConfig(model=ModelConfig(path=str(M.MODEL_DIR)), pool=PoolConfig(pool_bytes=16 << 20))
    cluster = InProcCluster(cfg)
    try:
        ex = M.make_examples(2, seed=0)[1]
        for policy, budget in (("full", None), ("vlcache", 0.1)):
            req = build_request(
                images=[_png(im) for im in ex.images],
                question=ex.question,
                max_new_tokens=M.MAX_NEW_TOKENS,
                policy=policy,
                budget=budget,
            )
            out = generate(cluster.stub, req, timeout=120)
            assert out.finished.usage.prompt_tokens > 1500
            if policy == "full":
                assert is_correct(out.text, ex), out.text
    finally:
        cluster.close()
