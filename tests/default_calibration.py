"""The profile ``vlkv calibrate`` writes for the default model on two synthetic prompts (the fixture ``calibrated_profile``
builds it once per session for the calibration tests of tests/unit, tests/integration and lab/tests)."""

from __future__ import annotations

from pathlib import Path

from calib_prompts import synthetic_prompts
from vlkv.common.config import DEFAULT_MODEL_DIR
from vlkv.deploy.calibrate.measure import calibrate

BUDGETS = (0.05, 0.1)


def calibrate_profile(out: Path) -> Path:
    """Calibrate the default model at ``BUDGETS`` on two prompts (4 tokens each) into ``out``; the profile's path."""
    prompts = synthetic_prompts(out, 2, seed=3)
    path, _, _ = calibrate(
        str(DEFAULT_MODEL_DIR), str(prompts), BUDGETS, tokens=4, out=str(out / "p.json"), rerank=0
    )
    return path
