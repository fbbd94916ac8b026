"""ZipCache-style normalized attention: accumulated attention divided by how many queries saw the token.

Accumulated attention favours early tokens (more rows can see them); dividing column j by its number of
unmasked entries ``n_j`` removes that length bias. This is H2O's all-rows statistics with the shared
``row_normalized`` option (``selection.shape_scores``: ``n_j = m - max(j, q0)``). Uniform layer budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from .h2o import H2OPolicy


@dataclass
class ZipCachePolicy(H2OPolicy):
    """Score = ``sum_{h in group} col_sum_hj / n_j`` over every prompt row."""

    name = "zipcache"
    row_normalized: bool = True
