"""PyramidKV: SnapKV's pooled observation-window scores with linearly decreasing layer budgets.

Statistics: the last ``min(m, window)`` rows, like SnapKV. Budgets: ``allocators.Pyramid`` (beta 20).
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocators import Allocator, Pyramid
from .snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV scoring; allocator ``Pyramid()`` (first layer ~2x, last ~1/20 of the mean)."""

    name = "pyramidkv"
    allocator: Allocator = Pyramid()
