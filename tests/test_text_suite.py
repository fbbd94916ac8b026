"""The real-text suite: deterministic items of the asked length, disjoint splits, scoring."""

import pytest
from vlkv.tools.zoo import text_suite as ts


@pytest.fixture(scope="module")
def tok():
    return ts.default_tokenizer()


def _key(it):
    return (it.context, it.question, it.answer)


@pytest.mark.parametrize("task", ts.TASKS)
def test_items_are_deterministic_of_the_length_and_hold_their_answer(task, tok):
    a = ts.items(task, 1024, "heldout", n=6, seed=1, tokenizer=tok)
    b = ts.items(task, 1024, "heldout", n=6, seed=1, tokenizer=tok)
    assert [_key(x) for x in a] == [_key(x) for x in b]
    assert [_key(x) for x in a] != [
        _key(x) for x in ts.items(task, 1024, "heldout", 6, seed=2, tokenizer=tok)
    ]
    for it in a:
        n = len(tok(ts.render(it, tok), add_special_tokens=False)["input_ids"])
        assert 1024 - 40 <= n <= 1024
        assert it.answer in it.context and it.images == ()
        assert it.messages == [{"role": "user", "content": [{"type": "text", "text": it.text}]}]
        assert ts.render(it, tok).endswith(f"{it.question}<|im_end|>\n<|im_start|>assistant\n")
    longer = ts.items(task, 2048, "heldout", n=1, seed=1, tokenizer=tok)[0]
    assert 2048 - 40 <= len(tok(ts.render(longer, tok))["input_ids"]) <= 2048


def test_splits_do_not_overlap(tok):
    for task in ts.TASKS:
        train = {_key(x) for x in ts.items(task, 1024, "train", n=20, tokenizer=tok)}
        held = {_key(x) for x in ts.items(task, 1024, "heldout", n=20, tokenizer=tok)}
        assert len(train) == len(held) == 20 and not train & held
    with pytest.raises(ValueError):
        ts.items("needle", 1024, "test", n=1, tokenizer=tok)
    with pytest.raises(ValueError):
        ts.items("nope", 1024, "train", n=1, tokenizer=tok)


def test_scoring_wants_the_answer_as_a_word_before_the_end_of_turn(tok):
    it = ts.items("needle", 1024, "train", n=1, tokenizer=tok)[0]
    assert ts.is_correct(f"The secret number is {it.answer}.", it) and it.is_correct(it.answer)
    assert not ts.is_correct(f"The secret number is {it.answer}7.", it)
    assert not ts.is_correct(f"1{it.answer}", it)
    assert not ts.is_correct(f"I do not know.<|im_end|>{it.answer}", it)
    p = ts.items("passage", 1024, "train", n=1, tokenizer=tok)[0]
    assert ts.is_correct(p.answer.lower(), p) and not ts.is_correct("Nowhere", p)
