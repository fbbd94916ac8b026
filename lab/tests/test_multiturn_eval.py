"""The lab's multi-turn evaluation (lab/vlkv_lab/eval/multiturn.py): its arms and its bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from vlkv.common.config import ModelConfig
from vlkv.common.model.loading import load_model, load_processor
from vlkv_lab.eval import multiturn


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    path = tiny_model_dirs("llava-gqa")
    return load_model(ModelConfig(path=path)), load_processor(path)


def _chats(n=3):
    """Chats about one random image each, in the tiny model's vocabulary (its tokenizer knows a few words)."""
    rng = np.random.default_rng(0)
    questions = ("what colour is the square", "what shape is it", "is there a red circle")
    chats = []
    for i in range(n):
        image = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        chats.append(
            multiturn.Chat(
                (image,), " ".join(["there are two blue triangles"] * (i + 1)), questions, (None,) * 3
            )
        )
    return chats


def test_messages_carry_the_history_and_images_once():
    chat = multiturn.Chat(("img",), "", ("q1", "q2", "q3"), (None, None, None))
    msgs = multiturn.messages(chat, 2, ["a1", "a2"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    images = [p for m in msgs for p in m["content"] if p["type"] == "image"]
    assert len(images) == 1 and msgs[0]["content"][0]["type"] == "image"
    assert [p["text"] for m in msgs for p in m["content"] if p["type"] == "text"] == [
        "q1",
        "a1",
        "q2",
        "a2",
        "q3",
    ]


def test_text_chats_ask_three_different_needles():
    from vlkv_lab.zoo.text_suite import default_tokenizer

    for chat in multiturn.text_chats(default_tokenizer(), 3, 512):
        values = [s.answer for s in chat.scored]
        assert len(set(values)) == multiturn.TURNS
        assert all(v in chat.preamble for v in values)
        for s in chat.scored:  # every other needle's value makes an answer wrong
            assert set(s.wrong) == set(values) - {s.answer}
            assert s.is_correct(f"it is {s.answer}.") and not s.is_correct(f"{s.answer} or {s.wrong[0]}")


def test_at_full_budget_every_arm_answers_as_the_full_cache(tiny):
    """Budget 1.0: re-compression and the oracle keep everything, and continuation appends each turn's new
    tokens to the previous turn's whole cache, so all arms decode the full cache's tokens."""
    model, processor = tiny
    task = multiturn.TurnTask(lambda text, scored: True)
    r = multiturn.run_suite(model, processor, _chats(), task, [1.0], 6, log=lambda *_: None)
    assert r["fallbacks"] == 0
    for turn in ("1", "2", "3"):
        cell = r["turns"][turn]["1.0"]
        for arm in multiturn.ARMS:
            assert cell[arm]["texts"] == cell["full"]["texts"], (turn, arm)
            assert cell[arm]["ratio"] == pytest.approx(1.0)
        if turn != "1":  # a whole cache with the new tokens appended reproduces the full cache's draft
            assert cell["held"] == len(_chats())


def test_continuation_keeps_every_appended_token(tiny):
    """Below full, a continued cache is the first turn's compact cache plus every later token: its realized
    ratio grows per turn while re-compression's stays at the budget."""
    model, processor = tiny
    task = multiturn.TurnTask(lambda text, scored: True)
    r = multiturn.run_suite(model, processor, _chats(), task, [0.1], 4, log=lambda *_: None)
    cont = [r["turns"][t]["0.1"]["continue"]["ratio"] for t in ("1", "2", "3")]
    rc = [r["turns"][t]["0.1"]["recompress"]["ratio"] for t in ("1", "2", "3")]
    assert cont[0] == pytest.approx(rc[0])
    assert cont[0] < cont[1] < cont[2]
    assert max(rc) < 0.2
    for t in ("2", "3"):  # a verified turn keeps the continued cache or the re-compressed one, nothing else
        cell = r["turns"][t]["0.1"]
        ver, held = cell["verified"]["ratio"], cell["held"]
        assert 0 <= held <= len(_chats())
        assert (ver > cell["recompress"]["ratio"]) == (held > 0)
    table = multiturn.table({"tiny": r})
    assert "| 3 | 10% |" in table
