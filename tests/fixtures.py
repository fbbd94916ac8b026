"""The fixtures every test folder shares; ``tests/conftest.py`` and ``lab/tests/conftest.py`` import them."""

from __future__ import annotations

import pytest
from tiny_models import DECODER_VARIANTS, TINY_VARIANTS, save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """name -> directory of a saved random tiny model; built lazily, once per session."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            variant = TINY_VARIANTS.get(name) or DECODER_VARIANTS[name]
            built[name] = save_tiny_model(tmp_path_factory.mktemp(name), **variant)
        return built[name]

    return get


@pytest.fixture(scope="session")
def calibrated_profile(tmp_path_factory):
    """Path of the profile ``vlkv calibrate`` wrote for the default model (``default_calibration.BUDGETS``)."""
    from default_calibration import calibrate_profile  # on first use: the calibration code is heavy to import

    return calibrate_profile(tmp_path_factory.mktemp("calibrate"))
