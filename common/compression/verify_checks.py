"""The checks of verified compression's request values (``verify.py`` explains the modes); apart from
``verify.py`` so that ``registry.py`` can validate a request without importing the presets."""

from __future__ import annotations

import math

VERIFY_MODES = ("off", "select", "floor")


def check_mode(value: str, what: str = "verify") -> str:
    if value not in VERIFY_MODES:
        raise ValueError(f"{what} must be one of {', '.join(VERIFY_MODES)}, got {value!r}")
    return value


def check_floor(value: float, what: str = "fidelity_floor") -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{what} must be in [0, 1], got {value}")
    return float(value)


def check_cap(value: float, what: str = "max_budget") -> float:
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{what} must be in (0, 1], got {value}")
    return float(value)
