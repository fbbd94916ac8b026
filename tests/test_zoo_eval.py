"""vlkv eval --zoo's machinery without a model: shared decodes of identical caches, the text tasks' full-cache
screen before any row, and the ``--rows`` filter of the ablation rows."""

from types import SimpleNamespace

import pytest
import torch
from vlkv.tools.eval import zoo_text
from vlkv.tools.eval.zoo import ABLATION, _configs
from vlkv.tools.eval.zoo_scoring import FULL, _decode_unique


def _cache(*positions):
    return SimpleNamespace(kept_indices=[torch.tensor([list(positions)])])


def test_caches_that_keep_the_same_positions_are_decoded_once():
    seen = []

    def decode(caches):
        seen.append(list(caches))
        return None, [f"answer {id(c)}" for c in caches]

    # two rows of two examples; row 2 keeps what row 1 keeps for example 0 only
    a0, a1, b0, b1 = _cache(1, 2), _cache(3, 4), _cache(1, 2), _cache(3, 5)
    answers = _decode_unique(decode, [a0, a1, b0, b1], 2)
    assert len(seen) == 1 and len(seen[0]) == 3  # b0 shares a0's decode
    assert answers[0] == answers[2] and len(set(answers)) == 3
    # the same positions for another example are another cache
    answers = _decode_unique(decode, [_cache(1), _cache(1)], 2)
    assert len(seen[-1]) == 2 and answers[0] != answers[1]


class _Task:
    name = "text fake 1K"
    geometry = "fake"
    max_new_tokens = 4

    def __init__(self, right):
        self.right = right

    def make_examples(self, n, seed, split):
        return list(range(n))


def _fake_pipeline(monkeypatch, right_of):
    calls = {"prepare": 0, "rows": []}

    def prepare(model, processor, part, progress, task, next_attention):
        calls["prepare"] += 1
        calls.setdefault("prepare_items", []).append(len(part))
        return [SimpleNamespace(m=10, example=i) for i in part]

    def full_answers(model, processor, prepared, max_new_tokens):
        return [[p.example] for p in prepared], {FULL: {"1.0": [right_of(p.example) for p in prepared]}}

    def score_rows(model, processor, prepared, ids, configs, budgets, max_new_tokens, oracle):
        assert ids == [[p.example] for p in prepared]  # the first pass's answers, example by example
        calls["rows"].append(len(prepared))
        return {"row": {"0.1": [True] * len(prepared)}}

    monkeypatch.setattr(zoo_text, "prepare", prepare)
    monkeypatch.setattr(zoo_text, "full_answers", full_answers)
    monkeypatch.setattr(zoo_text, "score_rows", score_rows)
    return calls


def test_a_text_task_the_model_cannot_do_stops_after_the_first_screen_and_runs_no_row(monkeypatch):
    calls = _fake_pipeline(monkeypatch, lambda i: False)
    r = zoo_text.run_task(None, None, _Task(0), 50, 0, "heldout", [], [0.1], 25, True, screen=10)
    assert "dropped" in r and calls["prepare"] == 1 and calls["rows"] == []
    assert len(r["hits"][FULL]["1.0"]) == 10


def test_a_task_below_the_bar_stops_once_too_many_are_wrong_and_runs_no_row(monkeypatch):
    calls = _fake_pipeline(monkeypatch, lambda i: i % 6 != 0)  # 41 of 50 right: 0.82
    r = zoo_text.run_task(None, None, _Task(0), 50, 0, "heldout", [], [0.1], 25, True, screen=10)
    # the 6th wrong one (item 30) rules out 0.9 of 50; the Wilson bound alone would have run all 50
    assert "dropped" in r and calls["rows"] == [] and len(r["hits"][FULL]["1.0"]) == 40


def test_a_task_the_model_can_do_scores_every_row_in_chunks(monkeypatch):
    calls = _fake_pipeline(monkeypatch, lambda i: True)
    monkeypatch.setattr(zoo_text, "_nbytes", lambda p: 1)
    monkeypatch.setattr(zoo_text, "KEEP_BYTES", 12)  # the first 12 prefills are kept for the rows
    r = zoo_text.run_task(None, None, _Task(0), 30, 0, "heldout", [], [0.1], 25, True, screen=10)
    assert "dropped" not in r and calls["rows"] == [25, 5]
    assert calls["prepare_items"] == [10, 10, 10, 13, 5]  # 3 screens, then the items not kept
    assert len(r["hits"]["row"]["0.1"]) == 30 and r["real_decoder"]


def test_rows_filter_picks_ablation_rows_by_label_and_refuses_unknown_ones():
    labels = [ABLATION[0][0], ABLATION[-1][0]]
    assert [row[0] for row in _configs(True, " | ".join(labels))] == labels
    assert _configs(True) == list(ABLATION)
    with pytest.raises(ValueError, match="unknown --rows"):
        _configs(True, "no such row")
