"""``calibrate_check`` (``lab/vlkv_lab/calibrate_check.py``) on a profile ``vlkv calibrate`` wrote for the default
model: the default and the profile's entry per budget on a member's held-out examples."""

from __future__ import annotations

import re

from default_calibration import BUDGETS
from vlkv.common.compression.profile import read_profile
from vlkv_lab.calibrate_check import check_member


def test_the_held_out_check_reads_the_profiles_entry_per_budget(calibrated_profile):
    """``calibrate_check``: the default and the profile's entry per budget on a member's held-out examples,
    each with its Wilson interval, and their difference in points."""
    lines = check_member("default", str(calibrated_profile), 4, BUDGETS)
    assert lines[0].startswith("default (held-out, n=4, full ")
    profile = read_profile(calibrated_profile)
    rows = [line for line in lines if re.match(r"\| 0\.\d+ \|", line)]
    assert len(rows) == len(BUDGETS)
    interval = re.compile(r"([\d.]+) \(([\d.]+)-([\d.]+)\)")
    for b, row in zip(BUDGETS, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        d, d_lo, d_hi = map(float, interval.match(cells[1]).groups())
        p = float(interval.match(cells[2]).group(1))
        assert d_lo <= d <= d_hi and f"({profile.entry_for(b).candidate} @ " in cells[2]
        assert float(cells[3]) == round(100 * (p - d), 1)
