"""Protocol v2.2's tie rule (lab/vlkv_lab/eval/protocol_ties.py): among candidates the scores cannot separate, fewer
changed answers against the current default, then fewer changed budgets (the resolved policy), then the
table's order; a score difference is never overridden."""

import json
from types import SimpleNamespace

import pytest
from vlkv.common.compression.registry import DEFAULT_TEXT_PRESET
from vlkv_lab.eval import protocol
from vlkv_lab.eval.protocol_kinds import decide_kinds
from vlkv_lab.eval.protocol_rules import CURRENT, choose
from vlkv_lab.eval.protocol_ties import budget_changes, recorded, resolved
from vlkv_lab.eval.zoo_report import finalize
from vlkv_lab.eval.zoo_scoring import FULL, ORACLE_DEFAULT, ORACLE_OWN

BUDGETS = (0.01, 0.1)
B = tuple(map(str, BUDGETS))
N = 20
SPAN, SKIP, BY = "vlcache_text_span", "vlcache_text_lean_w24_skip32", "vlcache_text_by_budget"
S, Y = f"text-only prompts: preset {SKIP}", f"text-only prompts: preset {BY}"
TEXTS = ["text needle 1K", "text kv 1K", "text hop 1K"]


def hits(k: int, shift: int = 0) -> list[bool]:
    """``k`` of ``N`` right, the right ones starting at ``shift`` (same accuracy, other examples)."""
    return [(i - shift) % N < k for i in range(N)]


def member(rows: dict) -> dict:
    """rows: {label: (hits at 1%, hits at 10%)}; oracles and the full cache all right (nothing model-bound)."""
    h = {FULL: {"1.0": hits(N)}} | {o: {b: hits(N) for b in B} for o in (ORACLE_DEFAULT, ORACLE_OWN)}
    h |= {label: dict(zip(B, by_b, strict=True)) for label, by_b in rows.items()}
    return finalize({"hits": h, "m": 100, "real_decoder": True, "geometry": ""})


def configs(**presets) -> dict:
    return {label: {"policy": "vlcache", "params": {"text_preset": p}} for label, p in presets.items()}


def with_configs(results: dict, cfg: dict) -> dict:
    for r in results.values():
        r["configs"] = cfg
    return results


CFG = configs(**{CURRENT: SPAN, "a": SPAN, "b": SPAN, S: SKIP, Y: BY})


@pytest.mark.parametrize("order", [[CURRENT, "a", "b"], [CURRENT, "b", "a"]])
def test_a_score_tie_goes_to_the_candidate_with_the_current_defaults_answers(order):
    # a and b: 14 right at 1% (the default 8) and 18 at 10% like the default; b's 18 are the default's
    rows = {CURRENT: (hits(8), hits(18)), "a": (hits(14), hits(18, shift=1)), "b": (hits(14), hits(18))}
    results = with_configs({t: member(rows) for t in TEXTS}, CFG)
    choice = choose(results, TEXTS, order, BUDGETS)
    assert choice.label == "b"
    assert choice.changes["b"][0] == 3 * 6 and choice.changes["a"][0] == 3 * (
        6 + 2
    )  # 1%: 6, 10%: 2 per member
    assert choice.changes[CURRENT] == (0, 0) and choice.not_comparable == []


@pytest.mark.parametrize("order", [[CURRENT, S, Y], [CURRENT, Y, S]])
def test_tied_on_answers_the_candidate_equal_to_the_default_at_more_budgets_wins(order):
    # the same answers: the policies decide. by_budget is the default's policy at 10%, skip32 at no budget
    rows = {CURRENT: (hits(8), hits(18)), S: (hits(14), hits(18)), Y: (hits(14), hits(18))}
    results = with_configs({t: member(rows) for t in TEXTS}, CFG)
    choice = choose(results, TEXTS, order, BUDGETS)
    assert choice.label == Y and choice.changes[Y] == (18, 1) and choice.changes[S] == (18, 2)


def test_budget_changes_resolve_the_policy_for_the_prompt_kind():
    assert budget_changes(CFG, Y, CURRENT, "text", (0.01, 0.02, 0.05, 0.1, 0.2)) == 3  # below 7.5%
    assert budget_changes(CFG, S, CURRENT, "text", (0.01, 0.1)) == 2
    assert budget_changes(CFG, "a", CURRENT, "text", (0.01, 0.1)) == 0
    # image prompts never reach a text preset: the text-preset rows change nothing there
    assert budget_changes(CFG, S, CURRENT, "image", (0.01, 0.1)) == 0
    assert resolved(CFG[Y], "text", 0.1) == resolved(CFG[CURRENT], "text", 0.1)
    assert (
        resolved(CFG[Y], "text", 0.01)
        == resolved(CFG[S], "text", 0.01)
        != resolved(CFG[CURRENT], "text", 0.01)
    )
    broken = {"x": {"policy": "vlcache", "params": {"text_preset": "no such preset"}}}
    assert resolved(broken["x"], "text", 0.1) is None
    assert budget_changes(CFG | broken, "x", CURRENT, "text", (0.01, 0.1)) == 2  # unresolvable: changed


def test_budget_changes_read_the_policies_the_run_recorded_not_todays_defaults():
    # a "defaults" row recorded when the default's text preset was skip32: its file keeps what it ran
    then = {"policy": "vlcache", "params": {}}
    then["resolved"] = json.loads(json.dumps(recorded(CFG[S], BUDGETS)))  # as the zoo JSON holds it
    cfg = CFG | {CURRENT: then}
    assert budget_changes(cfg, S, CURRENT, "text", BUDGETS) == 0
    assert budget_changes(cfg, Y, CURRENT, "text", BUDGETS) == 1  # by_budget is skip32 at 1% only
    # without the record, "{}" reads as today's defaults, whatever those are now
    bare = CFG | {CURRENT: {"policy": "vlcache", "params": {}}}
    today = CFG | {CURRENT: {"policy": "vlcache", "params": {"text_preset": DEFAULT_TEXT_PRESET["vlcache"]}}}
    assert (
        budget_changes(bare, S, CURRENT, "text", BUDGETS)
        == budget_changes(today, S, CURRENT, "text", BUDGETS)
        > 0
    )
    # a budget the run did not record is resolved from the params
    assert (
        budget_changes(cfg, S, CURRENT, "text", (0.2,))
        == budget_changes(today, S, CURRENT, "text", (0.2,))
        == 1
    )


def test_a_score_difference_is_never_overridden():
    # the default has 0 changes but scores 10 points below on every member: far outside the tie
    rows = {CURRENT: (hits(8), hits(18)), S: (hits(14, shift=3), hits(18, shift=5))}
    results = with_configs({t: member(rows) for t in TEXTS}, CFG)
    assert choose(results, TEXTS, [CURRENT, S], BUDGETS).label == S
    # equal on the worst member (the same scores), the mean still separates: a is better on two members, so
    # the default's zero changes do not count
    rows = {CURRENT: (hits(14), hits(18)), "a": (hits(14, shift=2), hits(18, shift=2))}
    better = {CURRENT: (hits(14), hits(18)), "a": (hits(16, shift=2), hits(18, shift=2))}
    results = with_configs({TEXTS[0]: member(rows), **{t: member(better) for t in TEXTS[1:]}}, CFG)
    choice = choose(results, TEXTS, [CURRENT, "a"], BUDGETS)
    assert choice.label == "a" and choice.changes[CURRENT] == (0, 0) and choice.changes["a"][0] > 0


def test_a_member_without_per_example_hits_is_not_comparable_and_left_out():
    rows = {CURRENT: (hits(8), hits(18)), "a": (hits(14), hits(18, shift=1)), "b": (hits(14), hits(18))}
    results = with_configs({t: member(rows) for t in TEXTS}, CFG)
    del results[TEXTS[0]]["hits"]["b"]  # rows (accuracies) kept, per-example hits lost
    choice = choose(results, TEXTS, [CURRENT, "a", "b"], BUDGETS)
    assert choice.not_comparable == [TEXTS[0]]
    assert choice.label == "b" and choice.changes["b"][0] == 2 * 6 and choice.changes["a"][0] == 2 * 8


def test_the_needle_fold_of_issue_38_now_checks_by_budget():
    """by_budget and skip32 share every answer on the other text tasks (skip32 is only worse on needle at
    10%): with needle left out they tie on every score and on answers; by_budget changes fewer budgets, so
    that fold checks by_budget whatever the table's order (skip32's row first, as in ``ABLATION``)."""
    base = {CURRENT: (hits(8), hits(18)), S: (hits(14), hits(18)), Y: (hits(14), hits(18))}
    needle = {CURRENT: (hits(8), hits(18)), S: (hits(14), hits(16)), Y: (hits(14), hits(18))}
    train = with_configs({TEXTS[0]: member(needle)} | {t: member(base) for t in TEXTS[1:]}, CFG)
    heldout = with_configs({TEXTS[0]: member(needle)} | {t: member(base) for t in TEXTS[1:]}, CFG)
    text, _ = decide_kinds(train, heldout, BUDGETS)
    assert [f.choice for f in text.decision.folds] == [Y, Y, Y]
    assert text.adopted and text.preset == BY, text.decision.reasons


def test_run_protocol_writes_version_2_2_and_the_tie_keys(tmp_path):
    base = {CURRENT: (hits(8), hits(18)), S: (hits(14), hits(18)), Y: (hits(14), hits(18))}
    needle = {CURRENT: (hits(8), hits(18)), S: (hits(14), hits(16)), Y: (hits(14), hits(18))}
    paths = []
    for split in ("train", "heldout"):
        results = {TEXTS[0]: member(needle)} | {t: member(base) for t in TEXTS[1:]}
        (tmp_path / f"{split}.json").write_text(
            json.dumps({"split": split, "n": N, "configs": CFG, "results": results})
        )
        paths.append(str(tmp_path / f"{split}.json"))
    assert protocol.run_protocol(SimpleNamespace(protocol=paths, out=str(tmp_path / "out"))) == 0
    summary = json.loads((tmp_path / "out" / "protocol.json").read_text())
    assert summary["version"] == "2.2" and summary["text"]["preset"] == BY
    assert summary["text"]["changes"][CURRENT] == [0, 0]
    assert "| changed answers | changed budgets |" in (tmp_path / "out" / "protocol.md").read_text()


def test_files_whose_defaults_row_ran_other_policies_are_refused_not_merged(tmp_path):
    results = {TEXTS[0]: member({CURRENT: (hits(8), hits(18)), S: (hits(14), hits(18))})}
    then, now = (
        {"policy": "vlcache", "params": {}, "resolved": json.loads(json.dumps(recorded(CFG[p], BUDGETS)))}
        for p in (S, Y)
    )

    def write(name: str, split: str, current: dict) -> str:
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps({"split": split, "n": N, "configs": CFG | {CURRENT: current}, "results": results})
        )
        return str(path)

    same = [write("train", "train", then), write("heldout", "heldout", then)]
    assert protocol.run_protocol(SimpleNamespace(protocol=same, out=str(tmp_path / "ok"))) == 0
    mixed = [same[0], write("heldout_later", "heldout", now)]  # the default changed between the runs
    with pytest.raises(SystemExit, match="'vlcache \\(defaults\\)' recorded other policies"):
        protocol.run_protocol(SimpleNamespace(protocol=mixed, out=str(tmp_path / "no")))
    bare = [same[0], write("heldout_bare", "heldout", {"policy": "vlcache", "params": {}})]  # no record: kept
    assert protocol.run_protocol(SimpleNamespace(protocol=bare, out=str(tmp_path / "bare"))) == 0
