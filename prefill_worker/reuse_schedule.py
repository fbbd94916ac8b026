"""How much of a reused image each layer recomputes: per-layer ratios from a mode, a budget, a calibration.

VLCache (``002``): ratios ``r_l`` in ``{0, 0.1, ..., 1}``, non-increasing with depth (a token recomputed in
layer l+1 was recomputed in layer l, so its hidden state exists), chosen greedily to minimise
``sum_l S_l(r_l)`` under ``sum_l r_l <= ratio * L``: each step raises by 0.1 the layer (among those the
monotone constraint allows) whose sensitivity drops most. ``S_l(r)`` is measured by ``vlkv calibrate-reuse``
(``deploy/calibrate/reuse.py``) and stored as JSON beside the model (``CALIBRATION_FILE``); without that file
the documented default (``default_sensitivity``) is used: layer 0 insensitive (the K/V it computes for
image tokens do not depend on the text before the image; ``vlkv calibrate-reuse`` measures it flat),
deeper layers ``S_l(r) = (1 - (l - 1) / L) * (1 - r)^2`` (shallower more sensitive, returns diminishing
with r): e.g. 4 layers at 5% -> ``[0.1, 0.1, 0, 0]``, at 10% -> ``[0.1, 0.1, 0.1, 0.1]``.
The number of 0.1 steps is ``round(10 * ratio * L)``, so the realized mean can differ from ``ratio``
(reported per request).

MPIC (``003``): the same ``ratio`` in every layer. ``none``: zeros.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
CALIBRATION_FILE = "reuse_calibration.json"
STEPS = 10  # ratios are multiples of 1 / STEPS


@dataclass(frozen=True)
class Calibration:
    """Per-layer sensitivities ``sensitivity[l][k]``: the output error when layer l recomputes ``k / 10`` of
    the image's earliest tokens (``k = 0 .. 10``), measured on ``examples`` prompts of model ``fingerprint``."""

    fingerprint: str
    sensitivity: list[list[float]]
    examples: int = 0
    metric: str = ""

    def to_json(self) -> str:
        body = {
            "fingerprint": self.fingerprint,
            "examples": self.examples,
            "metric": self.metric,
            "sensitivity": self.sensitivity,
        }
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        sens = data["sensitivity"]
        if not isinstance(sens, list) or not sens:
            raise ValueError("sensitivity must be a non-empty list of layers")
        rows = [[float(x) for x in row] for row in sens]
        if any(len(row) != STEPS + 1 or not all(math.isfinite(x) for x in row) for row in rows):
            raise ValueError(f"each layer needs {STEPS + 1} finite sensitivities (ratios 0, 0.1, ..., 1)")
        return cls(str(data["fingerprint"]), rows, int(data.get("examples", 0)), str(data.get("metric", "")))


def default_sensitivity(num_layers: int) -> list[list[float]]:
    """Layer 0 flat (its K/V of image tokens depend only on the image and the position, which the rotation
    restores: recomputing there changes nothing); deeper layers ``(1 - (l - 1) / L) * (1 - r)^2``."""
    flat = [1.0] * (STEPS + 1)
    deeper = [
        [(1 - (i - 1) / num_layers) * (1 - k / STEPS) ** 2 for k in range(STEPS + 1)]
        for i in range(1, num_layers)
    ]
    return [flat, *deeper]


def load_calibration(model_dir: str | Path, fingerprint: str, num_layers: int) -> Calibration | None:
    """The calibration stored beside the model, if it exists and was measured on this model (same
    fingerprint and layer count); otherwise None (the default schedule), with a warning if one was refused."""
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        cal = Calibration.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    if cal.fingerprint != fingerprint or len(cal.sensitivity) != num_layers:
        log.warning("ignoring %s: measured on another model (fingerprint or layer count differ)", path)
        return None
    return cal


def greedy_ratios(sensitivity: list[list[float]], steps: int) -> list[float]:
    """002's greedy allocation of ``steps`` increments of 0.1 under the non-increasing constraint.

    Raising layer i by 0.1 also raises the layers above it that sit at its level (so the ratios stay
    non-increasing): each candidate move costs that many steps and is ranked by its sensitivity drop per
    step; the best move that fits the remaining budget is taken until none does."""
    n = len(sensitivity)
    level = [0] * n
    left = steps
    while left > 0:
        best, best_gain = None, 0.0
        for i in range(n):
            if level[i] >= STEPS:
                continue
            chain = [j for j in range(i + 1) if level[j] == level[i]]
            if len(chain) > left:
                continue
            drop = sum(sensitivity[j][level[j]] - sensitivity[j][level[j] + 1] for j in chain)
            gain = drop / len(chain)
            if best is None or gain > best_gain:
                best, best_gain = chain, gain
        if best is None:
            break
        for j in best:
            level[j] += 1
        left -= len(best)
    return [k / STEPS for k in level]


def layer_ratios(
    mode: str, ratio: float, num_layers: int, calibration: Calibration | None = None
) -> list[float]:
    """Per-layer recompute ratios for a request's reuse ``mode`` and budget ``ratio``."""
    if mode == "none":
        return [0.0] * num_layers
    if mode == "mpic":
        return [ratio] * num_layers
    if mode != "layerwise":
        raise ValueError(f"unknown reuse mode {mode!r}")
    sens = calibration.sensitivity if calibration is not None else default_sensitivity(num_layers)
    return greedy_ratios(sens, round(STEPS * ratio * num_layers))


def recomputed_counts(ratios: list[float], num_tokens: int) -> list[int]:
    """Image tokens recomputed per layer (the earliest ones): ``ceil(r_l * n)``, forced non-increasing."""
    counts, last = [], num_tokens
    for r in ratios:
        c = min(last, math.ceil(round(r * num_tokens, 6)))
        counts.append(c)
        last = c
    return counts
