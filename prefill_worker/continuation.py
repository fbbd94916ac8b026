"""Continuation on the compressed cache (``ReuseParams.conversation = "continue"``, opt-in): a follow-up turn
appended to the compact cache of the conversation's previous turn, with no prefill of the history and no
re-compression.

The prefill worker keeps the compact cache it handed off for a turn sent with ``continue`` (``Retained``:
keyed by the prompt's block chain, ``common/prefix_key.py``, so per model and tenant; checked against the
prompt's ids and the KV layout before use; bounded in bytes, least recently used out). A later prompt that
extends one it kept exactly (its ids start with the kept prompt's) has its new tokens (the answer, the next
question) run over that compact cache in one forward (``common/model/forced.append_tokens``: the
teacher-forcing pass, whose K/V it keeps), and the compact cache plus the new tokens' full K/V is handed off
as this turn's cache. Nothing is verified: the compact cache was chosen for the earlier question, and a
later one may need what it dropped (KVzip, 2025, measures that failure; ``docs/conversations.md`` ours).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from vlkv.common.handoff.compact_kv import CompactKV


@dataclass(slots=True)
class RetainedCache:
    ids: tuple[int, ...]  # the prompt the cache was built for
    cache: CompactKV
    policy: str

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def usable(self, ids: list[int], layout: tuple[int, int, int], dtype: torch.dtype) -> bool:
        """True if ``ids`` extends this prompt by at least one token and the cache fits ``layout`` (L, H_kv,
        D) in ``dtype`` and holds finite numbers."""
        n = len(self.ids)
        layers, kv_heads, head_dim = layout
        c = self.cache
        return (
            len(ids) > n
            and tuple(ids[:n]) == self.ids
            and c.prompt_length == n
            and len(c.keys) == layers
            and all(k.shape[0] == kv_heads and k.shape[2] == head_dim and k.dtype == dtype for k in c.keys)
            and all(bool(torch.isfinite(t).all()) for t in (*c.keys, *c.values))
        )


class Retained:
    """The compact caches kept for ``continue`` turns, by the key of their prompt's last full block."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self._entries: OrderedDict[str, RetainedCache] = OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self.rejected = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, keys: list[str], entry: RetainedCache) -> bool:
        """Keep ``entry`` under its prompt's block chain ``keys`` (a prompt shorter than one block, or a cache
        larger than the whole store, is not kept)."""
        if not keys or entry.nbytes > self.capacity:
            return False
        with self._lock:
            self._drop(keys[-1])
            while self._entries and self._bytes + entry.nbytes > self.capacity:
                self._drop(next(iter(self._entries)))
            self._entries[keys[-1]] = entry
            self._bytes += entry.nbytes
        return True

    def find(self, keys: list[str], ids: list[int], layout, dtype) -> RetainedCache | None:
        """The longest kept prompt that ``ids`` extends (``keys``: its block chain); a kept cache that fails
        its checks is dropped."""
        with self._lock:
            for key in reversed(keys):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.usable(ids, layout, dtype):
                    self._entries.move_to_end(key)
                    return entry
                if tuple(ids[: len(entry.ids)]) == entry.ids:  # the same prompt, a cache that cannot serve
                    self._drop(key)
                    self.rejected += 1
        return None

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    @property
    def bytes_held(self) -> int:
        return self._bytes
