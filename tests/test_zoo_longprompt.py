"""Zoo member longprompt: determinism, disjoint splits, the long prompt's shape, scoring, the checkpoint."""

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
        (objs,) = ex.objects
        assert len({o.colour for o in objs}) == len(objs)  # colours are the keys: unique per scene
        (_, obj) = ex.focus[0]
        words = ex.question.split()
        assert [w for w in words if w in longprompt.SCORED] == [obj.colour]  # the one key, no distractors
        assert ex.question.endswith(longprompt.CLOSING)
        places.append(words.index(obj.colour) / len(words))
        assert ex.answer.split()[1:3] == [obj.colour, obj.shape]  # neither deciding word is the first token
    assert min(places) < 0.2 and max(places) > 0.8 and sum(0.2 < p < 0.8 for p in places) > 40
    assert [w for w in longprompt.SYSTEM_PROMPT.split() if w in longprompt.SCORED] == []


def test_training_curriculum_grows_the_message_to_the_evaluated_length():
    short = longprompt.train_example(5, 0.0)
    assert len(short.question.split()) < longprompt.MIN_QUESTION_TOKENS
    assert len(longprompt.train_example(5, 0.5).question.split()) >= longprompt.MIN_QUESTION_TOKENS
    assert longprompt.train_example(5, 0.5).question != longprompt.make_example(5, split="heldout").question


def test_scoring_needs_the_copied_key_and_the_shape():
    ex = longprompt.make_examples(1)[0]
    (_, obj) = ex.focus[0]
    assert longprompt.is_correct(ex.answer, ex)
    other_s = next(s for s in ("square", "circle", "triangle", "cross") if s != obj.shape)
    other_c = next(c for c in ("red", "green", "blue") if c != obj.colour)
    assert not longprompt.is_correct(f"the {obj.colour} {other_s} .", ex)
    assert not longprompt.is_correct(f"the {other_c} {obj.shape} .", ex)
    assert not longprompt.is_correct(f"the {obj.colour} .", ex)
    assert longprompt.is_correct(ex.answer + "</s> the red cross", ex)


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
