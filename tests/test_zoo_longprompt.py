"""Zoo member longprompt: determinism, disjoint splits, the long prompt's shape, scoring, the checkpoint."""

import random

import pytest
from vlkv.tools.task.tiny_llava import build_tokenizer
from vlkv.tools.zoo import longprompt, member


def _fingerprint(ex):
    return (tuple(im.tobytes() for im in ex.images), ex.question, ex.answer, ex.kind)


def test_generator_is_deterministic_and_seeded():
    a, b = longprompt.make_examples(30, seed=3), longprompt.make_examples(30, seed=3)
    assert [_fingerprint(x) for x in a] == [_fingerprint(x) for x in b]
    assert longprompt.make_example(7, seed=3).question == a[7].question
    assert [_fingerprint(x) for x in a] != [_fingerprint(x) for x in longprompt.make_examples(30, seed=4)]


def test_splits_are_disjoint():
    train = {_fingerprint(x) for x in longprompt.make_examples(60, split="train")}
    heldout = {_fingerprint(x) for x in longprompt.make_examples(60, split="heldout")}
    assert not train & heldout
    with pytest.raises(ValueError):
        longprompt.make_example(0, split="validation")


def test_long_instruction_and_long_question_with_the_key_inside():
    tok = build_tokenizer(longprompt.WORDS, longprompt.SYSTEM_PROMPT)
    assert len(tok(longprompt.SYSTEM_PROMPT)["input_ids"]) >= 100
    places = []
    for ex in longprompt.make_examples(100):
        ids = tok(ex.question)["input_ids"]
        assert len(ids) >= 100 and tok.unk_token_id not in ids
        (_, card) = ex.focus[0]
        words = ex.question.split()
        assert [w for w in words if w in longprompt.SCORED] == [card.colour]  # the one key, no distractors
        assert ex.question.endswith(longprompt.CLOSING)
        places.append(words.index(card.colour) / len(words))
        assert ex.answer.split()[3] == card.colour and ex.answer.split()[6] == card.shape
    assert min(places) < 0.2 and max(places) > 0.8 and sum(0.2 < p < 0.8 for p in places) > 40
    _, at = longprompt.long_question(random.Random(0), "red")
    assert at >= 0


def test_scoring_needs_the_copied_key_and_the_pattern():
    ex = longprompt.make_examples(1)[0]
    (_, card) = ex.focus[0]
    assert longprompt.is_correct(ex.answer, ex)
    other_p = next(p for p in longprompt.PATTERNS if p != card.shape)
    other_c = next(c for c in ("red", "green", "blue") if c != card.colour)
    assert not longprompt.is_correct(f"you asked about {card.colour} , {card.colour} {other_p} .", ex)
    assert not longprompt.is_correct(f"you asked about {other_c} , {card.colour} {card.shape} .", ex)
    assert not longprompt.is_correct(f"you asked about {card.colour} , {card.colour} .", ex)
    assert longprompt.is_correct(ex.answer + "</s> red rows", ex)


def test_member_interface_and_shipped_checkpoint():
    m = member("longprompt")
    assert m.NAME == "longprompt" and m.GEOMETRY and callable(m.prompt_text)
    if not (m.MODEL_DIR / "config.json").exists():
        pytest.skip("checkpoint not trained yet")
    from transformers import AutoConfig
    from vlkv.common.model.loading import load_processor

    cfg = AutoConfig.from_pretrained(m.MODEL_DIR)
    processor = load_processor(str(m.MODEL_DIR))
    ex = m.make_examples(1)[0]
    ids = list(processor(images=ex.images, text=m.prompt_text(processor, ex))["input_ids"][0])
    first, n_img = ids.index(cfg.image_token_index), ids.count(cfg.image_token_index)
    assert n_img == 144 and first >= 100 and len(ids) - first - n_img >= 100
    assert sum(f.stat().st_size for f in m.MODEL_DIR.iterdir()) <= 10 << 20
