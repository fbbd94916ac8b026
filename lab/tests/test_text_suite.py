"""The real-text suite: deterministic items of the asked length, disjoint splits, scoring."""

import pytest
from vlkv_lab.zoo import text_ruler
from vlkv_lab.zoo import text_suite as ts


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
        assert all(v in it.context for v in it.answers or (it.answer,)) and it.images == ()
        assert all(v in it.context for v in it.wrong) and not set(it.wrong) & set(it.answers)
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


def _noise_only(context: str, facts: int) -> bool:
    """The context is RULER's noise sentences, in order, with ``facts`` other sentences among them."""
    sentences = [s.strip() + "." for s in context.split(".") if s.strip()]
    rest = [s for s in sentences if s not in text_ruler.NOISE]
    kept = [s for s in sentences if s in text_ruler.NOISE]
    cycle = [text_ruler.NOISE[i % len(text_ruler.NOISE)] for i in range(len(kept))]
    return kept == cycle and len(rest) == facts


def test_ruler_tasks_hide_their_facts_in_the_noise_or_the_sentences(tok):
    shapes = {
        "niah_single_1": (1, "noise"),
        "niah_code": (1, "noise"),
        "niah_word": (1, "noise"),
        "niah_multikey_1": (3, "noise"),
        "niah_multivalue": (2, "noise"),
        "niah_multiquery": (2, "noise"),
        "niah_single_2": (1, "grammar"),
        "niah_single_3": (1, "grammar"),
    }
    for task, (facts, haystack) in shapes.items():
        for it in ts.items(task, 1024, "train", n=3, tokenizer=tok):
            assert _noise_only(it.context, facts) == (haystack == "noise"), task
            assert it.context.count("special magic") == facts, task
    vt = ts.items("vt_1hop", 1024, "train", n=3, tokenizer=tok)
    for it in vt:  # "VAR A = 12345." and "VAR B = VAR A." split into three sentences at the dots
        a, b = it.answers
        assert f"VAR {a} = " in it.context and f"VAR {b} = VAR {a}." in it.context
        assert it.context.index(f"VAR {a} =") < it.context.index(f"VAR {b} =")


def test_ruler_scoring_is_strict_on_every_value(tok):
    one = ts.items("niah_single_1", 1024, "heldout", n=1, tokenizer=tok)[0]
    v = one.answer
    assert len(v) == 7 and v.isdigit() and ts.is_correct(f"The special magic number is {v}.", one)
    assert not ts.is_correct(f"The special magic number is {v[:-1]}.", one)  # truncated
    changed = v[:-1] + str((int(v[-1]) + 1) % 10)
    assert not ts.is_correct(f"The special magic number is {changed}.", one)
    code = ts.items("niah_single_3", 1024, "heldout", n=1, tokenizer=tok)[0]
    assert ts.is_correct(f"The code is {code.answer.upper()}.", code)
    assert not ts.is_correct(code.answer.split("-")[0], code)
    word = ts.items("niah_word", 1024, "heldout", n=1, tokenizer=tok)[0]
    assert word.answer in text_ruler.VALUE_WORDS and ts.is_correct(f'"{word.answer}"', word)
    assert not ts.is_correct("there and back again", word)
    mk = ts.items("niah_multikey_1", 1024, "heldout", n=1, tokenizer=tok)[0]
    assert len(mk.wrong) == 2 and ts.is_correct(mk.answer, mk)
    assert not ts.is_correct(f"{mk.answer} or {mk.wrong[0]}", mk)  # a hedge over the needles
    assert not ts.is_correct(mk.wrong[1], mk)
    for task in ("niah_multivalue", "niah_multiquery", "vt_1hop"):
        it = ts.items(task, 1024, "heldout", n=1, tokenizer=tok)[0]
        a, b = it.answers
        assert it.answer == f"{a}, {b}" and a != b
        assert ts.is_correct(f"{b} and {a}", it) and ts.is_correct(f"\n* {a}\n* {b}", it)
        assert not ts.is_correct(f"{a}, {a}", it) and not ts.is_correct(b, it)


def test_ruler_tasks_leave_room_for_their_longer_answers():
    assert ts.max_new_tokens("needle") == ts.MAX_NEW_TOKENS
    assert ts.max_new_tokens("niah_single_1") > ts.MAX_NEW_TOKENS
    assert ts.max_new_tokens("niah_multiquery") > ts.max_new_tokens("niah_single_1")


def test_the_default_run_takes_tasks_the_model_can_do():
    assert "needle" in ts.DEFAULT_TASKS and set(ts.DEFAULT_TASKS) <= set(ts.PASSING_TASKS) < set(ts.TASKS)
    assert not {"multikey", "kv", "tracing", "passage", "niah_word", "vt_1hop"} & set(ts.PASSING_TASKS)
