"""The floors hold: `lint-imports` checks the contracts in pyproject.toml ([tool.importlinter])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason=f"import-linter is not installed ({LINT_IMPORTS} missing)"
)
def test_import_contracts_are_kept() -> None:
    run = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
