"""Synthetic visual question task: determinism, splits, scoring, and the shipped default model."""

from pathlib import Path

import pytest
import torch
from vlkv.tools.task.synthetic_task import (
    CATEGORY_WORDS,
    IMAGE_SIZE,
    KINDS,
    VOCAB,
    generate_answer,
    is_correct,
    make_example,
    make_examples,
    scene_questions,
)

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "common" / "default_model"


def _fingerprint(ex):
    return (tuple(im.tobytes() for im in ex.images), ex.question, ex.answer, ex.kind)


def test_generator_is_deterministic():
    a = make_examples(40, seed=7)
    b = make_examples(40, seed=7)
    assert [_fingerprint(x) for x in a] == [_fingerprint(x) for x in b]
    assert make_example(13, seed=7).answer == a[13].answer
    c = make_examples(40, seed=8)
    assert [_fingerprint(x) for x in a] != [_fingerprint(x) for x in c]


def test_splits_are_disjoint():
    train = {_fingerprint(x) for x in make_examples(400, seed=0, split="train")}
    held = {_fingerprint(x) for x in make_examples(200, seed=0, split="heldout")}
    assert not train & held
    with pytest.raises(ValueError):
        make_examples(1, split="test")


def test_examples_are_well_formed():
    exs = make_examples(500, seed=3)
    assert {x.kind for x in exs} == set(KINDS)
    words = set(VOCAB)
    for ex in exs:
        assert all(im.size == (IMAGE_SIZE, IMAGE_SIZE) and im.mode == "RGB" for im in ex.images)
        assert len(ex.images) == (2 if ex.kind.endswith("_2img") else 1)
        assert set(ex.question.split()) <= words and set(ex.answer.split()) <= words
        # the deciding word is never the first answer token
        answer = ex.answer.split()
        assert answer[2] == ex.target and ex.target not in answer[:2]
        assert ex.target in CATEGORY_WORDS[ex.category]
        # question after the images; the question is well posed for the scene
        content = ex.messages[0]["content"]
        assert [p["type"] for p in content] == ["image"] * len(ex.images) + ["text"]
        qas = {(q.question, q.answer) for q in scene_questions(ex.objects)}
        assert (ex.question, ex.answer) in qas


def test_is_correct():
    exs = make_examples(200, seed=1)
    ex = next(x for x in exs if x.kind == "colour_of_shape")
    other = next(c for c in sorted(CATEGORY_WORDS["colour"]) if c != ex.target)
    shape = ex.objects[0][0].shape
    assert ex.answer.split()[2] == ex.target
    assert is_correct(ex.answer, ex)
    assert is_correct(f"{ex.answer} </s>", ex)
    assert is_correct(f"the {shape} {ex.target}", ex)
    assert not is_correct(f"the {shape} {other} .", ex)
    assert not is_correct(f"the {shape} {other} {ex.target} .", ex)
    assert not is_correct(f"the {shape}", ex)
    assert not is_correct("", ex)
    two = next(x for x in exs if x.kind == "colour_of_shape_2img")
    assert is_correct(two.answer, two)
    wrong = next(c for c in sorted(CATEGORY_WORDS["colour"]) if c != two.target)
    assert not is_correct(two.answer.replace(two.target, wrong), two)
    cnt = next(x for x in exs if x.kind == "count")
    assert is_correct(cnt.answer, cnt)
    assert not is_correct("there are " + ("two" if cnt.target != "two" else "three") + " .", cnt)


_HAVE_MODEL = (DEFAULT_MODEL / "model.safetensors").exists()


@pytest.mark.skipif(not _HAVE_MODEL, reason="default model not trained yet")
def test_default_model_answers_heldout_examples():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(2)
    processor = AutoProcessor.from_pretrained(DEFAULT_MODEL)
    model = LlavaForConditionalGeneration.from_pretrained(DEFAULT_MODEL).eval()
    cfg = model.config
    assert cfg.text_config.num_key_value_heads < cfg.text_config.num_attention_heads  # GQA
    assert cfg.text_config.num_hidden_layers >= 2
    assert cfg.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    assert sum(f.stat().st_size for f in DEFAULT_MODEL.iterdir()) <= 20 * 2**20
    exs = make_examples(24, seed=0, split="heldout")
    answers = [generate_answer(model, processor, ex) for ex in exs]
    hits = sum(is_correct(a, ex) for a, ex in zip(answers, exs, strict=True))
    assert hits >= 22, list(zip(answers, [ex.answer for ex in exs], strict=True))
    assert any(len(ex.images) == 2 for ex in exs)
