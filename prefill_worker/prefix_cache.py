"""The prefill worker's prefix cache: every layer's full K/V of the prompts it prefilled, block by block.

A block (``B`` tokens, ``common/prefix_key.py``) is keyed by the digest chain of everything up to its end
(ids, the worker's own image digests, the model fingerprint, the tenant), so a follow-up turn that repeats
a conversation's earlier prompt finds its blocks and prefills only the rest. Each block holds its ids too,
checked at every lookup with its layout and finiteness: a corrupt or foreign block ends the match (a miss
from there), and is dropped; it is never served.

Beside the image cache, with its own bound (``vlkv serve --prefix-cache-mb``): an image entry serves any
prompt that shows the image, a prefix block only its own conversation, and one LRU over both would let long
histories push out the images every request reuses. Bounded in bytes, least recently used out: a hit
touches its blocks deepest first, so a chain ages from its tail and a shared root block stays longest.
Storing is best effort: a block that does not fit is not stored, and nothing here fails a request.
Entries live in this process's memory only (never serialized, never read from the network).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefixBlock:
    ids: tuple[int, ...]
    keys: torch.Tensor  # [L, H_kv, B, D], post-RoPE at the block's positions
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def matches(self, ids: tuple[int, ...], layout: tuple[int, int, int], dtype: torch.dtype) -> bool:
        layers, kv_heads, head_dim = layout
        shape = (layers, kv_heads, len(ids), head_dim)
        return (
            self.ids == ids
            and tuple(self.keys.shape) == shape
            and tuple(self.values.shape) == shape
            and self.keys.dtype == dtype
            and self.values.dtype == dtype
            and bool(torch.isfinite(self.keys).all())
            and bool(torch.isfinite(self.values).all())
        )


@dataclass(slots=True)
class PrefixStats:
    blocks: int = 0
    bytes_held: int = 0
    capacity: int = 0
    lookups: int = 0
    hits: int = 0  # lookups whose blocks served a prompt
    hit_tokens: int = 0  # prompt tokens served from the cache
    lookup_tokens: int = 0  # prompt tokens looked up
    evictions: int = 0
    rejected: int = 0  # blocks found but refused (foreign or corrupt) and dropped


class PrefixCache:
    def __init__(self, capacity_bytes: int, block: int) -> None:
        if block < 1:
            raise ValueError("prefix block must be >= 1 token")
        self.capacity = max(0, int(capacity_bytes))
        self.block = block
        self._blocks: OrderedDict[str, PrefixBlock] = OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = PrefixStats(capacity=self.capacity)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def lookup(
        self, keys: list[str], ids, layout: tuple[int, int, int], dtype: torch.dtype
    ) -> list[PrefixBlock]:
        """The longest run of ``keys`` from the first that the cache holds, each block checked against the
        prompt's ``ids`` (a sequence of ints) and the KV ``layout`` ``(L, H_kv, D)``."""
        found: list[PrefixBlock] = []
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_tokens += len(ids)
            for i, key in enumerate(keys):
                entry = self._blocks.get(key)
                if entry is None:
                    break
                want = tuple(int(t) for t in ids[i * self.block : (i + 1) * self.block])
                if not entry.matches(want, layout, dtype):
                    self._drop(key)
                    self._stats.rejected += 1
                    break
                found.append(entry)
            for key in reversed(keys[: len(found)]):  # deepest first: the root ends most recent
                self._blocks.move_to_end(key)
        return found

    def count_hit(self, tokens: int) -> None:
        """A lookup's blocks served ``tokens`` prompt tokens (a hit)."""
        with self._lock:
            self._stats.hits += 1
            self._stats.hit_tokens += tokens

    def insert(self, keys: list[str], ids, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor]) -> int:
        """Store the blocks of ``keys`` not held yet, from per-layer ``[H_kv, m, D]`` K/V; returns how many
        were stored. Older blocks go first to make room; a block larger than the whole cache is not stored."""
        if not self.enabled or not keys:
            return 0
        B = self.block
        per_block = 2 * len(k_layers) * k_layers[0].shape[0] * B * k_layers[0].shape[-1]
        per_block *= k_layers[0].element_size()
        if per_block > self.capacity:
            return 0
        keys = keys[: self.capacity // per_block]  # a chain longer than the cache keeps its head
        with self._lock:
            todo = [i for i, key in enumerate(keys) if key not in self._blocks]
            for key in reversed(keys):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
        stored = 0
        for i in todo:
            span = slice(i * B, (i + 1) * B)
            entry = PrefixBlock(
                ids=tuple(int(t) for t in ids[span]),
                keys=torch.stack([k[:, span] for k in k_layers]).clone(),
                values=torch.stack([v[:, span] for v in v_layers]).clone(),
            )
            with self._lock:
                if keys[i] in self._blocks:
                    continue
                while self._blocks and self._bytes + entry.nbytes > self.capacity:
                    self._drop(next(iter(self._blocks)))
                    self._stats.evictions += 1
                self._blocks[keys[i]] = entry
                self._bytes += entry.nbytes
                stored += 1
        with self._lock:  # the chain just stored: root most recent, as a lookup leaves it
            for key in reversed(keys):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
        return stored

    def _drop(self, key: str) -> None:
        entry = self._blocks.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def stats(self) -> PrefixStats:
        with self._lock:
            s = self._stats
            return PrefixStats(
                len(self._blocks),
                self._bytes,
                self.capacity,
                s.lookups,
                s.hits,
                s.hit_tokens,
                s.lookup_tokens,
                s.evictions,
                s.rejected,
            )
