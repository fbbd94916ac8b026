"""``vlkv calibrate``'s candidates that are one candidate on the prompts at hand: a row that kept the same
positions as an earlier one on every prompt says so (``same_as``), ``--rerank`` and the screening's cut
count it once, and a
candidate that acts on a prompt as an earlier one does is not compressed again (the same table)."""

from __future__ import annotations

import json

import pytest
from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, profile_from_dict
from vlkv.common.compression.registry import policy_from_dict
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.deploy.calibrate import measure as cal
from vlkv.deploy.calibrate.measure import (
    CANDIDATES,
    Calibration,
    calibrate,
    format_table,
    rerank_set,
    survivors,
)

LABELS = [label for label, _ in CANDIDATES]


def test_same_as_names_the_first_candidate_that_kept_the_same_positions_on_every_prompt():
    out = Calibration()
    for numbers in ((0, 0, 1, 0, 2), (0, 0, 1, 1, 0)):  # per prompt: the cache of LABELS[0..4] at 0.05
        for label, number in zip(LABELS, numbers, strict=False):
            out.add((label, 0.05), 0.5, 0.1, number)
        out.add((LABELS[0], 0.1), 0.6, 0.1, 0)
        out.add((LABELS[1], 0.1), 0.6, 0.1, 1)  # another cache at this budget
    same = {(r["candidate"], r["budget"]): r.get("same_as") for r in out.rows()}
    assert same[LABELS[1], 0.05] == LABELS[0]  # the same cache on both prompts
    assert same[LABELS[2], 0.05] is None  # its own cache: nothing earlier kept the same positions
    assert same[LABELS[3], 0.05] is None  # the default's on one prompt only
    assert same[LABELS[4], 0.05] is None
    assert same[LABELS[1], 0.1] is None
    assert same[LABELS[0], 0.05] is None  # the first of its kind names nothing


def _row(label: str, agreement: float, same_as: str = "") -> dict:
    row = {"candidate": label, "budget": 0.02, "agreement": agreement, "kl": 0.5, "prompts": 10}
    row["policy"] = policy_from_dict(dict(CANDIDATES)[label]).to_dict()
    return row | ({"same_as": same_as} if same_as else {})


def test_the_rerank_set_counts_candidates_that_kept_the_same_cache_once():
    rows = [
        _row(LABELS[0], 0.8),
        _row(LABELS[1], 0.8, LABELS[0]),  # the default's cache: ranked beside it, not a second choice
        _row(LABELS[2], 0.8, LABELS[0]),
        _row(LABELS[7], 0.7),
        _row(LABELS[8], 0.7, LABELS[7]),
        _row(LABELS[9], 0.6),
        _row(LABELS[10], 0.9),
    ]
    assert rerank_set(rows, [0.02], 2) == {0.02: {LABELS[10], LABELS[0]}}
    assert rerank_set(rows, [0.02], 3) == {0.02: {LABELS[10], LABELS[0], LABELS[7]}}
    assert rerank_set(rows, [0.02], 4) == {0.02: {LABELS[10], LABELS[0], LABELS[7], LABELS[9]}}
    for r in rows:  # without the column every row counts
        r.pop("same_as", None)
    assert rerank_set(rows, [0.02], 3) == {0.02: {LABELS[10], LABELS[0], LABELS[1]}}


def test_the_screenings_cut_keeps_distinct_candidates():
    rows = [
        _row(LABELS[1], 0.9),
        _row(LABELS[2], 0.9, LABELS[1]),  # the same cache as LABELS[1] on the screening prompts
        _row(LABELS[3], 0.9, LABELS[1]),
        _row(LABELS[0], 0.7),
        _row(LABELS[7], 0.8),
        _row(LABELS[9], 0.6),
    ]
    assert survivors(rows, [0.02], 2) == {0.02: {LABELS[1], LABELS[7], LABELS[0]}}
    assert survivors(rows, [0.02], 3) == {0.02: {LABELS[1], LABELS[7], LABELS[0]}}  # the default's own place
    assert survivors(rows, [0.02], 4) == {0.02: {LABELS[1], LABELS[7], LABELS[0], LABELS[9]}}
    for r in rows:  # without the column every row counts
        r.pop("same_as", None)
    assert survivors(rows, [0.02], 2) == {0.02: {LABELS[1], LABELS[2], LABELS[0]}}


def test_a_profile_names_the_candidate_a_row_is_the_same_as_and_refuses_a_bad_one():
    entry = ProfileEntry(0.02, "default", policy_from_dict(PRESETS["vlcache_default"]))
    rows = [_row(LABELS[0], 0.8), _row(LABELS[1], 0.8, LABELS[0])]
    data = CompressionProfile(
        {"fingerprint": "fp"}, {"digest": "d", "count": 10}, {}, [entry], rows
    ).to_dict()
    lines = format_table(profile_from_dict(data)).splitlines()
    assert lines[3] == f"| {LABELS[1]} | 0.800 / 0.500 (= {LABELS[0]}) |"
    data["table"][1]["same_as"] = 3
    with pytest.raises(ValueError, match=r"table\[1\]\.same_as"):
        profile_from_dict(data)


def test_text_only_prompts_compress_each_acting_policy_once_to_the_same_table(tmp_path, monkeypatch):
    """On text-only prompts the options that act on images alone leave the default's cache: their rows say
    ``same_as`` the default, and compressing every candidate anyway (no ``_acting`` key shared) gives the
    same table."""
    prompts = tmp_path / "text.jsonl"
    lines = [
        "USER: The key of the red box is 4417. The sky is blue. The key of the blue box is 9051. "
        "What is the key of the red box? ASSISTANT:",
        "USER: Maya keeps the lamp. Omar keeps the map. Lena keeps the coin. Who keeps the map? ASSISTANT:",
    ]
    prompts.write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines))
    run = dict(budgets=(0.1,), tokens=4, rerank=0)
    made = []
    real = cal.compress_with
    monkeypatch.setattr(cal, "compress_with", lambda *a, **k: made.append(1) or real(*a, **k))
    _, shared, _ = calibrate(str(DEFAULT_MODEL_DIR), str(prompts), out=str(tmp_path / "a.json"), **run)
    counted = len(made)
    monkeypatch.setattr(cal, "_acting", lambda *a: object())  # every candidate its own key
    _, every, _ = calibrate(str(DEFAULT_MODEL_DIR), str(prompts), out=str(tmp_path / "b.json"), **run)
    assert len(made) - counted == 2 * len(CANDIDATES) and counted < len(made) - counted
    assert shared.table == every.table and shared.entries == every.entries
    same = {r["candidate"]: r.get("same_as") for r in shared.table}
    assert same["lookahead: off"] == same["pooling: off"] == same["allocator: uniform"] == "default"
    assert same["snapkv"] is None and same["default"] is None


def test_image_prompts_compress_each_acting_policy_once_to_the_same_table(tmp_path, monkeypatch):
    """With an image every option acts, each on its own policy; the rows the text-only options fill are the
    default's (``same_as``), and the shared compressions give the table compressing each one again gives."""
    from calib_prompts import synthetic_prompts

    prompts = synthetic_prompts(tmp_path, 1, seed=5)
    run = dict(budgets=(0.05,), tokens=4, rerank=0)
    _, shared, _ = calibrate(str(DEFAULT_MODEL_DIR), str(prompts), out=str(tmp_path / "a.json"), **run)
    monkeypatch.setattr(cal, "_acting", lambda *a: object())
    _, every, _ = calibrate(str(DEFAULT_MODEL_DIR), str(prompts), out=str(tmp_path / "b.json"), **run)
    assert shared.table == every.table and shared.entries == every.entries
    same = {r["candidate"]: r.get("same_as") for r in shared.table}
    assert same["text window: off"] == same["text-only: preset vlcache_text"] == "default"
