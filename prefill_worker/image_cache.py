"""The prefill worker's image cache: an image's projected vision features and every layer's K/V of its tokens.

Keyed by (model fingerprint, image hash, tenant): one tenant never reads another's entry (nor learns from a
hit's timing that another tenant sent an image), and an entry built by another model is never served.
Bounded in bytes, least recently used first out. Entries live in this process's memory only (never
serialized, never read from the network). ``get`` checks the entry against what the caller expects (the
fingerprint, the number of image tokens, the layer count and K/V layout) and drops an entry that does not
match, so a corrupt or foreign entry is a miss, never served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ImageKey:
    fingerprint: str  # the model's (ModelSpec.fingerprint)
    image_hash: str  # of the decoded image (the processor's pixel values)
    tenant: str  # the caller's identity ("anonymous" without an API token)


@dataclass(slots=True)
class ImageEntry:
    """One image: ``features [n, hidden]`` (the projector's output), per layer ``keys[l]``/``values[l]``
    ``[H_kv, n, D]`` (keys post-RoPE at positions ``start .. start+n-1``), and ``prefix_hash``: a digest of
    what came before and including the image when they were computed (an equal digest is an exact prefix
    hit: the K/V are exactly what this prompt would compute)."""

    fingerprint: str
    features: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int
    prefix_hash: str

    @property
    def num_tokens(self) -> int:
        return int(self.features.shape[0])

    @property
    def nbytes(self) -> int:
        tensors = [self.features, *self.keys, *self.values]
        return sum(t.numel() * t.element_size() for t in tensors)

    def matches(self, fingerprint: str, num_tokens: int, layout: tuple[int, int, int], hidden: int) -> bool:
        """True if this entry can stand in for ``num_tokens`` image tokens of the model ``fingerprint`` with
        KV layout ``(L, H_kv, D)`` and hidden size ``hidden`` (and holds finite numbers)."""
        layers, kv_heads, head_dim = layout
        shape = (kv_heads, num_tokens, head_dim)
        return (
            self.fingerprint == fingerprint
            and tuple(self.features.shape) == (num_tokens, hidden)
            and len(self.keys) == layers
            and len(self.values) == layers
            and all(tuple(t.shape) == shape for t in (*self.keys, *self.values))
            and self.start >= 0
            and all(bool(torch.isfinite(t).all()) for t in (self.features, *self.keys, *self.values))
        )


@dataclass(slots=True)
class CacheStats:
    entries: int = 0
    bytes_held: int = 0
    capacity: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # entries found but refused (foreign or corrupt) and dropped


CHANGE_LOG = 4096  # entries added or dropped that a load stream can catch up on (older: a full listing)


@dataclass(slots=True)
class CacheChanges:
    """What changed since a version (``ImageCache.changes_since``): keys added and dropped, or with ``full``
    every key held now (the caller was too far behind the change log)."""

    version: int
    added: list[ImageKey]
    dropped: list[ImageKey]
    full: bool


class ImageCache:
    """LRU by bytes; thread-safe (the prefill thread writes, the event loop reads the statistics)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity = capacity_bytes
        self._entries: OrderedDict[ImageKey, ImageEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = CacheStats(capacity=capacity_bytes)
        self.version = 0  # one per key added or dropped
        self._log: deque[tuple[int, bool, ImageKey]] = deque(maxlen=CHANGE_LOG)  # (version, added, key)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def get(
        self, key: ImageKey, *, num_tokens: int, layout: tuple[int, int, int], hidden: int
    ) -> ImageEntry | None:
        """The entry for ``key`` if it holds what the caller expects (``ImageEntry.matches``), else None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.matches(key.fingerprint, num_tokens, layout, hidden):
                self._drop(key)
                self._stats.rejected += 1
                entry = None
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return entry

    def put(self, key: ImageKey, entry: ImageEntry) -> bool:
        """Store ``entry`` (replacing one under the same key), evicting the least recently used until it
        fits; False if it is larger than the whole cache (nothing is stored, nothing evicted)."""
        if entry.fingerprint != key.fingerprint:
            raise ValueError("the entry was built by another model than its key names")
        size = entry.nbytes
        with self._lock:
            if size > self.capacity:
                return False
            if key in self._entries:
                self._drop(key)
            while self._bytes + size > self.capacity:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self._stats.evictions += 1
            self._entries[key] = entry
            self._bytes += size
            self._note(True, key)
            return True

    def _drop(self, key: ImageKey) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._note(False, key)

    def _note(self, added: bool, key: ImageKey) -> None:
        self.version += 1
        self._log.append((self.version, added, key))

    def changes_since(self, version: int) -> CacheChanges:
        """Keys added and dropped after ``version`` (-1: none seen yet, so every key held now)."""
        with self._lock:
            if version == self.version:
                return CacheChanges(version, [], [], False)
            if version < 0 or not self._log or self._log[0][0] > version + 1:
                return CacheChanges(self.version, list(self._entries), [], True)
            added: dict[ImageKey, bool] = {}
            for v, was_added, key in self._log:
                if v > version:
                    added[key] = was_added  # the last change of a key is what holds now
            return CacheChanges(
                self.version,
                [k for k, a in added.items() if a],
                [k for k, a in added.items() if not a],
                False,
            )

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ImageKey) -> bool:
        return key in self._entries

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        with self._lock:
            s = self._stats
            return CacheStats(
                len(self._entries), self._bytes, self.capacity, s.hits, s.misses, s.evictions, s.rejected
            )
