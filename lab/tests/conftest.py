"""pytest's hook for the lab's tests: the repository's ``tests/`` on ``sys.path`` (its support modules: fixtures,
in-process clusters, tiny models, ...) and the same shared fixtures as tests/unit and tests/integration."""

import sys
from pathlib import Path

import vlkv.deploy  # noqa: F401 - before transformers: keeps the checkout's root off sys.path

TESTS = str(Path(__file__).resolve().parents[2] / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from fixtures import calibrated_profile, tiny_model_dirs  # noqa: E402, F401 - the shared fixtures
