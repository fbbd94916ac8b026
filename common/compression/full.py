"""No compression: every layer keeps all m tokens; the cache is handed on bitwise unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class FullPolicy(Policy):
    """Budgets are m in every layer whatever alpha and allocator (``is_full`` is always True), so no
    statistics are read and ``score`` is never called."""

    name = "full"
    scores_need_stats = False
    always_full = True
