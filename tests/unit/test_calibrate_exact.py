"""``vlkv calibrate``'s whole-answer count (``exact``): counted per prompt, written in the profile's table and
its markdown, validated on reading, reported but not ranked on; a profile written before it was measured
still loads."""

from __future__ import annotations

import pytest
from vlkv.common.compression.presets import PRESETS
from vlkv.common.compression.profile import CompressionProfile, ProfileEntry, profile_from_dict
from vlkv.common.compression.registry import policy_from_dict
from vlkv.deploy.calibrate.measure import CANDIDATES, Calibration, best_per_budget, format_table, survivors


def _profile(rows) -> dict:
    entry = ProfileEntry(0.1, "default", policy_from_dict(PRESETS["vlcache_default"]))
    return CompressionProfile({"fingerprint": "fp"}, {"digest": "d", "count": 3}, {}, [entry], rows).to_dict()


def test_exact_counts_the_prompts_whose_every_position_agrees():
    cal = Calibration(trace=[{}])
    for agreement, kl in ((1.0, 0.0), (0.9, 0.1), (1.0, 0.2)):
        cal.add(("default", 0.1), agreement, kl)
    cal.add(("snapkv", 0.1), 0.99, 0.3)
    rows = {r["candidate"]: r for r in cal.rows()}
    assert rows["default"]["exact"] == round(2 / 3, 6) and rows["default"]["agreement"] == round(2.9 / 3, 6)
    assert rows["snapkv"]["exact"] == 0.0 and rows["snapkv"]["prompts"] == 1
    assert cal.trace == [{"default|0.1": [1.0, 0.2], "snapkv|0.1": [0.99, 0.3]}]


def test_the_table_shows_exact_and_an_older_profile_without_it_still_loads():
    policy = policy_from_dict(dict(CANDIDATES)["snapkv"]).to_dict()
    row = {"candidate": "snapkv", "budget": 0.1, "agreement": 0.95, "kl": 0.2, "prompts": 3, "policy": policy}
    new = profile_from_dict(_profile([{**row, "exact": 0.5}]))
    assert format_table(new).splitlines()[2] == "| snapkv | 0.50 / 0.950 / 0.200 |"
    assert "0.1: exact / agreement / KL" in format_table(new)
    old = profile_from_dict(_profile([row]))  # written before exact was measured
    assert "exact" not in old.table[0] and old.entries[0].candidate == "default"
    assert format_table(old).splitlines()[2] == "| snapkv | 0.950 / 0.200 |"
    for bad in (1.5, -0.1, "all"):
        with pytest.raises(ValueError, match=r"table\[0\]\.exact"):
            profile_from_dict(_profile([{**row, "exact": bad}]))


def test_the_choice_ranks_by_per_position_agreement_not_by_whole_answers():
    """Ranking by whole answers first chose the same entries as agreement on smol_codes, smol_objects and
    needle (common/compression/README.md, "Whole-answer agreement"), so the rule stays: the highest
    agreement, then the lower KL, then the grid's order, whatever the exact share."""
    labels = [label for label, _ in CANDIDATES]
    policies = dict(CANDIDATES)
    rows = [
        {"candidate": labels[i], "budget": 0.02, "agreement": a, "kl": kl, "exact": exact, "prompts": 10}
        | {"policy": policies[labels[i]]}
        for i, exact, a, kl in (
            (0, 0.30, 0.57, 1.0),  # more whole answers, fewer positions agree
            (1, 0.10, 0.85, 0.5),
            (2, 0.00, 0.85, 0.4),  # ties on agreement: the lower KL
        )
    ]
    assert survivors(rows, [0.02], 1) == {0.02: {labels[2], labels[0]}}
    (entry,) = best_per_budget(rows, [0.02])
    assert entry.candidate == labels[2]
