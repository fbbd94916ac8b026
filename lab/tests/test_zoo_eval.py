"""vlkv eval zoo's machinery without a model: shared decodes of identical caches, the text tasks' full-cache
screen before any row, and the ``--rows`` filter of the ablation rows."""

from types import SimpleNamespace

import pytest
import torch
from vlkv.deploy.progress import Progress
from vlkv_lab.eval import zoo_text
from vlkv_lab.eval.zoo import ABLATION, _command, _configs
from vlkv_lab.eval.zoo_scoring import FULL, _decode_unique


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
    calls = {"prepare": 0, "rows": [], "slim": []}

    def prepare(model, processor, part, progress, task, next_attention, counter=None):
        calls["prepare"] += 1
        calls.setdefault("prepare_items", []).append(len(part))
        if counter is not None:
            counter.update(len(part))
        out = [SimpleNamespace(m=10, example=i, q=[torch.zeros(2)]) for i in part]
        for p in out:  # keep_stats frees the queries
            p.keep_stats = lambda *a, p=p: (calls["slim"].append(p.example), setattr(p, "q", []))
        return out

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
    monkeypatch.setattr(zoo_text, "_nbytes", lambda p, slim=False: 1 if slim or not p.q else 2)
    # 6 whole prefills fit; at the 7th they are kept without their queries, and 6 more with them
    monkeypatch.setattr(zoo_text, "KEEP_BYTES", 12)
    bar = Progress(60, disable=True)
    r = zoo_text.run_task(None, None, _Task(0), 30, 0, "heldout", [], [0.1], 25, True, screen=10, bar=bar)
    assert "dropped" not in r and calls["rows"] == [25, 5]
    assert calls["prepare_items"] == [10, 10, 10, 13, 5]  # 3 screens, then the items not kept
    assert calls["slim"] == list(range(12))  # the kept ones keep their statistics, not their queries
    assert len(r["hits"]["row"]["0.1"]) == 30 and r["real_decoder"]
    assert bar.n == 60  # two steps an item: the screens' prefills (not the second ones), the rows


def test_prefills_that_fit_whole_are_kept_whole_and_a_dropped_task_computes_no_statistics(monkeypatch):
    calls = _fake_pipeline(monkeypatch, lambda i: True)
    r = zoo_text.run_task(None, None, _Task(0), 30, 0, "heldout", [], [0.1], 25, True, screen=10)
    assert calls["slim"] == [] and calls["prepare_items"] == [10, 10, 10] and "dropped" not in r
    calls = _fake_pipeline(monkeypatch, lambda i: False)
    zoo_text.run_task(None, None, _Task(0), 50, 0, "heldout", [], [0.1], 25, True, screen=10)
    assert calls["slim"] == []


def test_a_dropped_task_fills_its_share_of_the_runs_bar(monkeypatch):
    _fake_pipeline(monkeypatch, lambda i: False)
    bar = Progress(100, disable=True)
    zoo_text.run_task(None, None, _Task(0), 50, 0, "heldout", [], [0.1], 25, True, screen=10, bar=bar)
    assert bar.n == 100  # 10 prefills, then the rest of its 2 x 50 steps at once


def test_rows_filter_picks_ablation_rows_by_label_and_refuses_unknown_ones():
    labels = [ABLATION[0][0], ABLATION[-1][0]]
    assert [row[0] for row in _configs(True, " | ".join(labels))] == labels
    assert _configs(True) == list(ABLATION)
    with pytest.raises(ValueError, match="unknown --rows"):
        _configs(True, "no such row")


def _prepared(seed: int = 0, m: int = 48, tau: int = 16):
    from vlkv_lab.eval.evaluation import Prepared

    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(4, m, 8, generator=g) for _ in range(2)]
    k = [torch.randn(2, m, 8, generator=g) for _ in range(2)]
    v = [torch.randn(2, m, 8, generator=g) for _ in range(2)]
    return Prepared(None, m, tau, 3, q, k, v, [], 8**-0.5)


def test_a_prefill_kept_without_its_queries_compresses_bit_for_bit_as_before():
    from vlkv_lab.eval.evaluation import compress

    rows = [("h2o", "h2o", {}), ("snapkv", "snapkv", {}), ("pyramidkv", "pyramidkv", {"pyramid_beta": 2.0})]
    budgets = [0.05, 0.25, 1.0]
    slim, fresh = _prepared(), _prepared()
    slim.keep_stats(rows, budgets)
    assert slim.q == []  # the queries are freed
    for _, policy, params in rows:
        for b in budgets:
            a, c = compress(slim, policy, b, **params), compress(fresh, policy, b, **params)
            assert a.layer_lengths == c.layer_lengths
            assert all(torch.equal(x, y) for x, y in zip(a.keys, c.keys, strict=True))
            assert all(torch.equal(x, y) for x, y in zip(a.values, c.values, strict=True))
    with pytest.raises(ValueError, match="not kept"):  # a row it was not kept for fails loudly
        slim.stats(1, 0.01)


def test_the_runs_bar_weights_an_item_by_its_cost(monkeypatch):
    _fake_pipeline(monkeypatch, lambda i: False)
    bar = Progress(None, disable=True)
    weight = zoo_text.text_weight(2048)
    assert weight == 2 * zoo_text.text_weight(1024) > 1  # a 2K item counts twice a 1K one
    r = zoo_text.run_task(
        None,
        None,
        _Task(0),
        50,
        0,
        "heldout",
        [],
        [0.1],
        25,
        True,
        screen=10,
        bar=zoo_text.Steps(bar, weight),
    )
    assert "dropped" in r and bar.n == 100 * weight  # its whole share of the run, in weighted steps


def test_window_off_with_the_full_draft_weight_is_an_image_row():
    from vlkv.common.compression.registry import get_policy
    from vlkv_lab.eval.protocol_kinds import text_rows

    rows = {label: {"policy": p, "params": params} for label, p, params in ABLATION}
    label = "window: none + lookahead 16 (w 1.0)"
    policy = get_policy("vlcache", **rows[label]["params"])
    assert not policy.post_vision_window and policy.lookahead == 16 and policy.lookahead_weight == 1.0
    # today's text preset is kept, so protocol v2.1 reads it as an image-dimension candidate
    assert policy.text == get_policy("vlcache").text
    assert label not in text_rows(rows, "vlcache (defaults)")


def test_the_recorded_command_names_a_seed_other_than_the_default():
    args = SimpleNamespace(n=100, members="text", rows="", jobs="1", seed=2, ablation=True)
    assert " --seed 2" in _command(args, "heldout")
    assert "--seed" not in _command(SimpleNamespace(**{**vars(args), "seed": 0}), "heldout")


def test_the_text_dtype_is_bfloat16_unless_the_environment_names_another_and_results_record_it(monkeypatch):
    monkeypatch.delenv(zoo_text.DTYPE_ENV, raising=False)
    assert zoo_text.text_dtype() == "bfloat16"
    monkeypatch.setenv(zoo_text.DTYPE_ENV, "float32")
    assert zoo_text.text_dtype() == "float32"
    _fake_pipeline(monkeypatch, lambda i: True)
    r = zoo_text.run_task(None, None, _Task(0), 10, 0, "heldout", [], [0.1], 25, True, screen=10)
    assert r["dtype"] == "float32"
    monkeypatch.setenv(zoo_text.DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="VLKV_TEXT_DTYPE='fp8'.*bfloat16, float32, float16"):
        zoo_text.text_dtype()
