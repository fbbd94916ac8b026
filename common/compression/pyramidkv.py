"""PyramidKV: SnapKV's pooled observation-window scores with linearly decreasing layer budgets.

Statistics: the last ``min(m, window)`` rows, like SnapKV. Budgets: ``budgets.pyramid_budgets``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV scoring; allocator defaults to ``pyramid`` (first layer ~2x, last ~1/beta of the mean)."""

    name = "pyramidkv"
    allocator: str = "pyramid"
