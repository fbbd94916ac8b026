"""H2O (heavy hitters): accumulated attention over every prompt query row, uniform layer budgets.

Statistics: all rows, ``query_start = 0`` (O(m^2) work in the statistics kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class H2OPolicy(Policy):
    """Score = ``sum_{h in group} sum_{i=0}^{m-1} A_hij`` (causal softmax over the whole prompt): the base
    column-sum ``score`` over all rows."""

    name = "h2o"

    def query_start(self, m: int, tau: int, question: int = 0) -> int:
        """All prompt rows."""
        return 0
