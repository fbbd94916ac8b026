"""SnapKV: attention from a fixed observation window of the last w prompt rows, max-pooled over positions.

Pooling keeps the neighbours of a strongly attended token, so kept tokens come in small clusters.
Statistics: rows ``m - min(m, w) .. m-1``, independent of tau. Uniform layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class SnapKVPolicy(Policy):
    """window: observation rows w (default 8); pool_kernel: odd max-pool width (default 7, 1 = none; the
    base ``score`` pools)."""

    name = "snapkv"
    window: int = 8
    pool_kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def query_start(self, m: int, tau: int, question: int = 0) -> int:
        """The last ``min(m, window)`` rows."""
        return m - min(m, self.window)
