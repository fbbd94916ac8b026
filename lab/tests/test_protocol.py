"""The tuning protocol (lab/vlkv_lab/eval/protocol*.py) on made-up zoo results: v2's rules (scores relative to the
oracle, real members first, leave-one-member-out folds, adoption), v2.1's two dimensions (``text_preset`` on
the text tasks, every other option on the image members) and the saved JSON read back."""

import json
import math
from types import SimpleNamespace

import pytest
from vlkv_lab.eval import protocol
from vlkv_lab.eval.protocol_kinds import (
    DIFFERS,
    EQUAL,
    NO_IMAGE_EVIDENCE,
    NOT_MEASURED,
    decide_kinds,
    text_rows,
)
from vlkv_lab.eval.protocol_rules import CURRENT, choose, decide, load, score
from vlkv_lab.eval.zoo_report import finalize
from vlkv_lab.eval.zoo_scoring import FULL, ORACLE_DEFAULT, ORACLE_OWN

B = ("0.01", "0.1")
BUDGETS = (0.01, 0.1)
N = 20


def _hits(acc: float) -> list[bool]:
    k = round(N * acc)
    return [True] * k + [False] * (N - k)


def _member(rows: dict, oracle=(1.0, 1.0), real=False, eviction=False, full=1.0) -> dict:
    """rows: {label: (acc at 1%, acc at 10%)}."""
    hits = {FULL: {"1.0": _hits(full)}}
    for label, accs in {ORACLE_DEFAULT: oracle, ORACLE_OWN: oracle, **rows}.items():
        hits[label] = {b: _hits(a) for b, a in zip(B, accs, strict=True)}
    r = {"hits": hits, "m": 100, "eviction_trained": eviction, "real_decoder": real, "geometry": ""}
    return finalize(r)


def _configs(labels):
    return {x: {"policy": "vlcache", "params": {}} for x in labels} | {"snapkv": {"policy": "snapkv"}}


def test_score_is_relative_to_the_oracle_and_leaves_model_bound_cells_out():
    r = _member({"p": (0.75, 0.9)}, oracle=(0.95, 1.0))  # 1%: 0.75 / 0.95; 10%: 0.9 / 1.0
    assert score({"a": r}, "p", ["a"], BUDGETS) == pytest.approx((0.75 / 0.95 + 0.9) / 2)
    bound = _member({"p": (0.1, 0.9)}, oracle=(0.2, 1.0))  # 1% model-bound: oracle 0.2 < 0.9 of full
    assert score({"a": bound}, "p", ["a"], BUDGETS) == pytest.approx(0.9)
    both = {"a": r, "b": _member({"p": (0.5, 0.5)})}
    assert score(both, "p", ["a", "b"], BUDGETS) == pytest.approx((0.5 + 0.5) / 2)  # worst per budget
    both["b"] = _member({"p": (1.0, 0.5)})
    assert score(both, "p", ["a", "b"], BUDGETS) == pytest.approx((0.75 / 0.95 + 0.5) / 2)
    assert math.isnan(score(both, "missing", ["a"], BUDGETS))


def test_the_worst_member_decides_and_real_members_break_near_ties():
    labels = [CURRENT, "p", "q"]
    results = {
        "toy": _member({CURRENT: (0.5, 0.5), "p": (0.55, 0.55), "q": (0.2, 0.2)}),
        "text": _member({CURRENT: (0.6, 0.6), "p": (0.9, 0.9), "q": (1.0, 1.0)}, real=True),
    }
    # q is best on the real member but its worst member is far below; p and the current default are within
    # two items (of n = 20: 0.1) on the worst member, and the real member prefers p
    choice = choose(results, ["text", "toy"], labels, BUDGETS)
    assert choice.label == "p" and [row[0] for row in choice.table] == ["p", CURRENT, "q"]
    results["text"] = _member({CURRENT: (0.6, 0.6), "p": (0.5, 0.5), "q": (1.0, 1.0)}, real=True)
    assert choose(results, ["text", "toy"], labels, BUDGETS).label == CURRENT


def _zoo(p_on_c_heldout: float):
    """Three toys: ``p`` is best on a and b (train), so every fold that leaves out a or b still sees it win
    on the other; c is where its held-out accuracy is ``p_on_c_heldout`` against the current 0.6."""
    train = {
        "a": _member({CURRENT: (0.5, 0.8), "p": (0.7, 0.9)}),
        "b": _member({CURRENT: (0.5, 0.8), "p": (0.6, 0.9)}),
        "c": _member({CURRENT: (0.6, 0.6), "p": (0.6, 0.6)}),
        "ev": _member({CURRENT: (0.1, 0.1), "p": (0.0, 0.0)}, eviction=True),
    }
    heldout = {
        "a": _member({CURRENT: (0.5, 0.8), "p": (0.7, 0.9)}),
        "b": _member({CURRENT: (0.5, 0.8), "p": (0.6, 0.9)}),
        "c": _member({CURRENT: (0.6, 0.6), "p": (p_on_c_heldout, 0.6)}),
        "ev": _member({CURRENT: (0.5, 0.5), "p": (0.0, 0.0)}, eviction=True),
    }
    for r in [*train.values(), *heldout.values()]:
        r["configs"] = _configs([CURRENT, "p"])
    return train, heldout


def test_lomo_adopts_a_choice_that_holds_on_every_left_out_member():
    train, heldout = _zoo(0.6)
    d = decide(train, heldout, BUDGETS)
    assert d.choice.label == "p" and [f.left_out for f in d.folds] == ["a", "b", "c"]
    assert all(f.holds for f in d.folds)
    assert d.adopted, d.reasons  # the eviction-trained member's drop does not count
    assert "ev" not in d.checks


def test_a_choice_below_the_default_on_a_left_out_member_is_not_adopted():
    train, heldout = _zoo(0.55)  # p loses 5 points on c at 1%
    d = decide(train, heldout, BUDGETS)
    fold = next(f for f in d.folds if f.left_out == "c")
    assert fold.choice == "p" and fold.diffs[0] == pytest.approx(-5.0) and not fold.holds
    assert not d.adopted and any("c" in r for r in d.reasons)


def test_a_choice_that_wins_only_on_the_whole_set_is_tuned_to_it():
    # x is the best worst member over a, b, c; leave any one out and a specialist of the other two wins
    rows = {
        "a": {CURRENT: 0.6, "x": 0.7, "y": 0.9, "z": 0.5, "w": 0.9},
        "b": {CURRENT: 0.6, "x": 0.7, "y": 0.9, "z": 0.9, "w": 0.5},
        "c": {CURRENT: 0.6, "x": 0.7, "y": 0.5, "z": 0.9, "w": 0.9},
    }
    train = {n: _member({k: (v, v) for k, v in r.items()}) for n, r in rows.items()}
    for r in train.values():
        r["configs"] = _configs([CURRENT, "x", "y", "z", "w"])
    d = decide(train, train, BUDGETS)
    assert d.choice.label == "x"
    assert sorted(f.choice for f in d.folds) == ["w", "y", "z"]
    assert not d.adopted and any("tuned to the set: the choice wins 0 of 3" in r for r in d.reasons)


def test_run_protocol_reads_saved_zoo_json_and_merges_rows_run_apart(tmp_path):
    train, heldout = _zoo(0.6)

    def save(name, split, results, labels):
        keep = {
            m: {**r, "hits": {k: v for k, v in r["hits"].items() if k in (*labels, FULL, ORACLE_DEFAULT)}}
            for m, r in results.items()
        }
        data = {"split": split, "n": N, "configs": _configs(labels), "results": keep}
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    paths = [
        save("t1.json", "train", train, [CURRENT]),
        save("t2.json", "train", train, ["p"]),
        save("h.json", "heldout", heldout, [CURRENT, "p"]),
    ]
    merged = load(paths)
    assert set(merged["train"]["a"]["rows"]) == {CURRENT, "p", ORACLE_DEFAULT}
    out = tmp_path / "out"
    assert protocol.run_protocol(SimpleNamespace(protocol=paths, out=str(out))) == 0
    summary = json.loads((out / "protocol.json").read_text())
    # no text task in these files: the text dimension cannot leave one out; the image one is v2's
    assert summary["text"]["note"] == "not decidable: 0 text members" and not summary["text"]["adopted"]
    assert summary["image"]["choice"] == "p" and summary["image"]["adopted"]
    assert "Leave-one-member-out" in (out / "protocol.md").read_text()


# v2.1: one dimension per prompt kind. TP sets only text_preset; IMG is an option for every prompt.
TP, IMG = "text-only prompts: preset P", "pooling off"
TEXTS = ["text needle 1K", "text kv 1K", "text hop 1K"]


def _kinds_configs():
    return {
        CURRENT: {"policy": "vlcache", "params": {}},
        TP: {"policy": "vlcache", "params": {"text_preset": "vlcache_text"}},
        IMG: {"policy": "vlcache", "params": {"pool_kernel": 1}},
        "snapkv (baseline)": {"policy": "snapkv", "params": {}},
    }


def _kinds(texts=TEXTS, tp_on_last_text_heldout=0.9):
    """Text tasks where TP is far better than the default and IMG worse; two image members where TP gives
    the default's answers (image prompts unchanged) and IMG is better. ``tp_on_last_text_heldout``: TP's
    held-out accuracy at 1% on the last text task (the default's is 0.3)."""
    text = {CURRENT: (0.3, 0.4), TP: (0.9, 0.9), IMG: (0.1, 0.2)}
    image = {CURRENT: (0.5, 0.6), TP: (0.5, 0.6), IMG: (0.7, 0.8)}
    train = {t: _member(text, real=True) for t in texts} | {g: _member(image) for g in ("g", "h")}
    heldout = {t: _member(text, real=True) for t in texts} | {g: _member(image) for g in ("g", "h")}
    if texts:
        heldout[texts[-1]] = _member({**text, TP: (tp_on_last_text_heldout, 0.9)}, real=True)
    for r in [*train.values(), *heldout.values()]:
        r["configs"] = _kinds_configs()
    return train, heldout


def test_text_rows_are_those_that_differ_from_the_default_only_in_text_preset():
    configs = _kinds_configs() | {
        "lookup": {"policy": "vlcache", "params": {"span_after": 8, "text_preset": ""}},
        "both": {"policy": "vlcache", "params": {"text_preset": "vlcache_text", "pool_kernel": 1}},
        "on snapkv": {"policy": "snapkv", "params": {"text_preset": "vlcache_text"}},
    }
    assert text_rows(configs, CURRENT) == [TP]


def test_a_text_preset_is_adopted_when_it_holds_on_every_text_fold():
    text, image = decide_kinds(*_kinds(), BUDGETS)
    assert text.members == TEXTS and text.labels == [CURRENT, TP]  # the image option is not a text candidate
    assert [f.left_out for f in text.decision.folds] == TEXTS and all(
        f.choice == TP for f in text.decision.folds
    )
    assert text.adopted and text.preset == "vlcache_text", text.decision.reasons
    assert text.image_check == {"g": {TP: EQUAL}, "h": {TP: EQUAL}}


def test_a_text_preset_that_drops_a_text_fold_by_more_than_a_point_is_refused():
    text, _ = decide_kinds(*_kinds(tp_on_last_text_heldout=0.25), BUDGETS)  # 5 points below the default at 1%
    fold = next(f for f in text.decision.folds if f.left_out == TEXTS[-1])
    assert fold.choice == TP and fold.diffs[0] == pytest.approx(-5.0) and not fold.holds
    assert not text.adopted and text.preset == ""
    assert any("folds that do not hold" in r and TEXTS[-1] in r for r in text.decision.reasons)


def test_one_text_member_is_not_decidable_and_adopts_nothing():
    text, image = decide_kinds(*_kinds(texts=TEXTS[:1]), BUDGETS)
    assert text.note == "not decidable: 1 text member" and text.decision is None and not text.adopted
    assert text.choice.label == TP  # the scores are still shown
    assert image.texts_judge and TEXTS[0] in image.members  # no preset: the text task judges image options


def test_an_image_option_is_judged_without_the_text_tasks_only_when_a_preset_is_adopted():
    text, image = decide_kinds(*_kinds(), BUDGETS)
    assert text.adopted
    assert image.members == ["g", "h"] and not image.texts_judge and TP not in image.labels
    assert image.choice.label == IMG and image.adopted, image.decision.reasons  # worse on text: moot
    assert set(image.decision.checks) == {"g", "h"}
    text, image = decide_kinds(*_kinds(tp_on_last_text_heldout=0.25), BUDGETS)
    assert not text.adopted
    assert image.texts_judge and image.members == [*TEXTS, "g", "h"]
    # IMG loses 20 points on every text task: the worst member picks the default, nothing is adopted
    assert image.choice.label == CURRENT and not image.adopted


def test_a_text_preset_row_that_differs_on_an_image_member_is_flagged():
    train, heldout = _kinds()
    hits = heldout["g"]["hits"][TP]["0.01"]
    heldout["g"]["hits"][TP]["0.01"] = hits[::-1]  # same accuracy, other examples right
    finalize(heldout["g"])
    del heldout["h"]["hits"][TP], heldout["h"]["rows"][TP]
    text, _ = decide_kinds(train, heldout, BUDGETS)
    assert text.image_check == {"g": {TP: DIFFERS}, "h": {TP: NOT_MEASURED}}
    assert not text.adopted and any("differs" in r and "g" in r for r in text.decision.reasons)


def test_text_only_files_leave_the_image_dimension_undecided(tmp_path):
    train, heldout = _kinds()
    paths = []
    for split, results in (("train", train), ("heldout", heldout)):
        keep = {t: results[t] for t in TEXTS}
        (tmp_path / f"{split}.json").write_text(
            json.dumps({"split": split, "n": N, "configs": _kinds_configs(), "results": keep})
        )
        paths.append(str(tmp_path / f"{split}.json"))
    out = tmp_path / "out"
    assert protocol.run_protocol(SimpleNamespace(protocol=paths, out=str(out))) == 0
    summary = json.loads((out / "protocol.json").read_text())
    assert summary["text"]["adopted"] and summary["text"]["preset"] == "vlcache_text"
    assert summary["image"]["note"] == NO_IMAGE_EVIDENCE and not summary["image"]["decided"]
    assert summary["image"]["members"] == [] and summary["image"]["candidates"] == []
    md = (out / "protocol.md").read_text()
    assert NO_IMAGE_EVIDENCE in md and "No image member in these files: not measured." in md


def test_one_image_member_is_not_decidable_and_adopts_nothing():
    """A file with one image member (a timing run) leaves no member to leave out: the scores are shown, the
    dimension is not decided (it used to stop with `min() arg is an empty sequence`)."""
    train, heldout = _kinds(texts=[])
    train, heldout = {"g": train["g"]}, {"g": heldout["g"]}
    text, image = decide_kinds(train, heldout, BUDGETS)
    assert image.note == "not decidable: 1 member" and image.decision is None and not image.adopted
    assert image.choice.label == IMG  # the scores are still shown
