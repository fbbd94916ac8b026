"""The keyword a transformers ``forward`` takes its KV cache by.

transformers 5.24 renamed ``past_key_values`` to ``cache`` on the model and decoder-layer forwards (the old
name is deprecated, to be removed in 5.40); earlier 5.x releases only know ``past_key_values``. Every place
that hands a cache to a forward asks :func:`cache_arg` so that both work without warnings.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

NEW, OLD = "cache", "past_key_values"


@functools.cache
def cache_kwarg(forward) -> str:
    """``"cache"`` if ``forward`` (a function; decorators that keep ``__wrapped__`` are seen through)
    names such a parameter, else ``"past_key_values"``."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return OLD
    return NEW if NEW in params else OLD


def cache_arg(module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` to splat into ``module(...)``, the name being what ``type(module).forward`` takes."""
    return {cache_kwarg(type(module).forward): cache}
