"""Block accounting for the decode worker's paged KV pool (no torch; the arithmetic, ``blocks_needed``, is
``common/block_math.py``'s, which the gateway's router shares).

The pool is ``num_blocks`` fixed-size blocks; a block is ``block_size`` tokens of one layer (K and V for
every KV head, stored in ``kv_cache.KVCache``). Each layer of a compact cache keeps a different number of
tokens, so a sequence owns one block table per layer (``SequenceBlocks``). Lifecycle of a sequence's
blocks: ``admit`` (or ``allocate``) when its cache arrives, ``append`` one token's room at a time while it
decodes, ``free`` when it finishes, is cancelled or is preempted. Running out of room is never raised
deep inside: ``allocate`` returns ``None``, ``append`` returns ``False`` (all or nothing) and ``admit``
returns an ``AdmissionRefusal`` naming its kind.

Admission (``PoolConfig.admission``, ``AdmissionPolicy``):

- ``grow`` (default): a cache takes the blocks of its own tokens; a new cache must leave ``watermark`` of
  the pool free, so running sequences have room to grow, and waits while preempted sequences wait to
  resume (they go first). Sequences take further blocks one at a time while decoding; when the pool runs
  out the scheduler preempts the newest (``scheduler.py``).
- ``reserve``: a cache also reserves ``max_new_tokens`` in every layer (a sliding layer: up to its ring),
  so decoding never needs a block it does not have and nothing is ever preempted; fewer sequences fit.

Either way a request that could not fit even in an empty pool is refused outright (``NEVER_FITS``); one
that does not fit now is refused with ``POOL_FULL`` (room may come later).

Sliding-window layers (``windows``, per layer its window ``W``, 0: none; from the model's ``ModelSpec``) are
rings: the decode attention reads the last ``W`` entries of such a layer only, so after every step ``slide``
drops the layer's leading blocks wholly before them (``block_math.dead_blocks``) and its length counts the
entries it still holds. Every count here caps such a layer's growth at ``block_math.ring_blocks``: under
``grow`` the dropped blocks go back to the pool (the layer takes one again a block's worth of tokens later);
under ``reserve`` a layer's reservation is its ring, and its dropped blocks move to the end of its own table,
so it never needs a block it does not have.

Idle blocks: a finished sequence kept for its conversation's next turn (``retention.py``) holds its blocks
idle. They count as room (``admit_room``, ``can_allocate``, ``can_append``): whenever ``allocate`` or ``append``
needs more blocks than are free, the ``idle`` holder gives back the least recently kept first, so a kept
cache never refuses a request nor preempts a running one.

Decode-phase re-compression (``--decode-budget``, off by default): a layer whose cache has grown to
``recompress_target``'s trigger is cut back to its budget (the decode core picks which tokens stay and
compacts them in place), and ``shrink`` returns the blocks past them to the pool.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vlkv.common.block_math import blocks_needed, ceil_div, dead_blocks, layer_blocks


def recompress_budget(prompt_time_len: int, budget: float, window: int) -> int:
    """Tokens a layer may keep while decoding: ``budget`` x its prompt-time length, plus ``window``."""
    return math.ceil(budget * prompt_time_len) + window


def recompress_target(prompt_time_len: int, length: int, budget: float, window: int, block_size: int) -> int:
    """Tokens a layer of ``length`` keeps after re-compression: its budget once it holds a block more than
    that (so every re-compression frees at least one block), else ``length`` (nothing to do); ``budget``
    <= 0 turns re-compression off."""
    if budget <= 0:
        return length
    cap = recompress_budget(prompt_time_len, budget, window)
    return cap if length >= cap + block_size else length


@dataclass
class SequenceBlocks:
    """Blocks held by one sequence: ``tables[l]`` lists layer l's block ids in token order."""

    tables: list[list[int]]

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.tables)


class RefusalKind(enum.Enum):
    POOL_FULL = "pool_full"  # no room now; room may come later (re-queue, retry)
    NEVER_FITS = "never_fits"  # larger than the whole pool with max_new_tokens


@dataclass(frozen=True)
class AdmissionRefusal:
    """Why ``BlockManager.admit`` took no blocks: a machine-readable ``kind`` and a message for humans."""

    kind: RefusalKind
    message: str


class IdleBlocks(Protocol):
    """Who holds blocks idle that it gives back on demand (``retention.RetainedCaches``)."""

    @property
    def held(self) -> int: ...  # blocks held idle

    def release(self, need: int) -> int: ...  # give back at least ``need`` blocks if it can; returns how many


@dataclass(frozen=True)
class AdmissionPolicy:
    """``reserve``: take ``max_new_tokens`` more in every layer at admission; ``watermark_blocks``: what a
    new cache must leave free (grow only)."""

    reserve: bool = False
    watermark_blocks: int = 0

    @classmethod
    def from_config(cls, admission: str, watermark: float, num_blocks: int) -> AdmissionPolicy:
        """``admission``: ``grow`` or ``reserve``; ``watermark``: share of ``num_blocks`` kept free."""
        reserve = admission == "reserve"
        return cls(reserve, 0 if reserve else int(watermark * num_blocks))


class BlockManager:
    """Free list and per-sequence block tables; every block is either free or owned by one sequence."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: AdmissionPolicy | None = None,
        windows: Sequence[int] = (),
    ) -> None:
        """``windows``: per layer its sliding window (0: none; ``()``: no layer slides), see the module."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if any(w < 0 or w == 1 for w in windows):
            raise ValueError(f"sliding windows must be 0 or >= 2, got {tuple(windows)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy or AdmissionPolicy()
        self.windows = tuple(windows) if any(windows) else ()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._used: set[int] = set()
        self.idle: IdleBlocks | None = None  # blocks held idle, given back on demand (``retention.py``)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle(self) -> int:
        """Blocks held idle (kept caches): in use, but room for whoever needs them."""
        return self.idle.held if self.idle is not None else 0

    def _make_room(self, need: int) -> bool:
        """At least ``need`` free blocks, idle ones given back if needed (none when even all of them would
        not do); whether there are."""
        short = need - len(self._free)
        if short > 0 and self.idle is not None and short <= self.idle.held:  # never in vain
            self.idle.release(short)
        return need <= len(self._free)

    # -- allocation verbs ----------------------------------------------------------------------------
    def _windows_for(self, layer_lengths: list[int]) -> tuple[int, ...]:
        if self.windows and len(self.windows) != len(layer_lengths):
            raise ValueError(f"{len(layer_lengths)} layers for a pool of {len(self.windows)}-layer windows")
        return self.windows or (0,) * len(layer_lengths)

    def blocks_needed(self, layer_lengths: list[int], extra_tokens: int) -> int:
        """Blocks ``allocate(layer_lengths, extra_tokens)`` takes: the most the layers hold while
        ``extra_tokens`` are appended, a sliding layer's capped by its ring."""
        return blocks_needed(layer_lengths, extra_tokens, self.block_size, self.windows)

    def can_allocate(self, layer_lengths: list[int], extra_tokens: int) -> bool:
        return self.blocks_needed(layer_lengths, extra_tokens) <= self.num_free + self.num_idle

    def allocate(self, layer_lengths: list[int], extra_tokens: int) -> SequenceBlocks | None:
        """Room for ``layer_lengths[l] + extra_tokens`` tokens in every layer, or None (nothing taken)."""
        if not self._make_room(self.blocks_needed(layer_lengths, extra_tokens)):
            return None
        windows = self._windows_for(layer_lengths)
        return SequenceBlocks(
            [
                self._take(layer_blocks(n, extra_tokens, self.block_size, w))
                for n, w in zip(layer_lengths, windows, strict=True)
            ]
        )

    def _take(self, count: int) -> list[int]:
        """``count`` free blocks, now in use (the caller checked there are)."""
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def _full_tables(self, blocks: SequenceBlocks, lengths: list[int]) -> list[list[int]]:
        """The layer tables with no free slot for token ``lengths[l]``."""
        return [t for t, n in zip(blocks.tables, lengths, strict=True) if n >= len(t) * self.block_size]

    def blocks_to_append(self, blocks: SequenceBlocks, lengths: list[int]) -> int:
        """New blocks ``append`` needs to place token ``lengths[l]`` of every layer l."""
        return len(self._full_tables(blocks, lengths))

    def can_append(self, blocks: SequenceBlocks, lengths: list[int]) -> bool:
        return self.blocks_to_append(blocks, lengths) <= self.num_free + self.num_idle

    def append(self, blocks: SequenceBlocks, lengths: list[int]) -> bool:
        """Make room for one more token in every layer (at index ``lengths[l]``); all or nothing."""
        grow = self._full_tables(blocks, lengths)
        if not self._make_room(len(grow)):
            return False
        for table in grow:
            table.extend(self._take(1))
        return True

    def grow(self, blocks: SequenceBlocks, lengths: list[int], extra: int) -> bool:
        """Room for ``extra`` more tokens in every layer (after ``lengths[l]``), idle blocks given back if
        needed; all or nothing (no sliding layers: a continued turn's, ``retention.py``)."""
        need = [
            max(0, ceil_div(n + extra, self.block_size) - len(t))
            for t, n in zip(blocks.tables, lengths, strict=True)
        ]
        if not self._make_room(sum(need)):
            return False
        for table, k in zip(blocks.tables, need, strict=True):
            table.extend(self._take(k))
        return True

    def slide(self, blocks: SequenceBlocks, lengths: list[int]) -> int:
        """After a step: drop every sliding layer's leading blocks that no later step reads (its cache,
        ``lengths[l]`` entries, is a run of its latest positions; the attention reads its last ``W``) and
        take their tokens off ``lengths[l]`` (in place), so each table and length keep token ``t`` in block
        ``t // block_size``. Under ``grow`` the blocks go back to the pool, under ``reserve`` to the end of
        the layer's own table (its ring). Returns the tokens dropped, all layers."""
        if not self.windows:
            return 0
        dropped = 0
        for layer, (n, w) in enumerate(zip(lengths, self._windows_for(lengths), strict=True)):
            table = blocks.tables[layer]
            dead = min(dead_blocks(n, w, self.block_size), len(table))
            if not dead:
                continue
            gone = table[:dead]
            del table[:dead]
            if self.policy.reserve:
                table.extend(gone)
            else:
                self._used.difference_update(gone)
                self._free.extend(reversed(gone))
            lengths[layer] = n - dead * self.block_size
            dropped += dead * self.block_size
        return dropped

    def shrink(self, blocks: SequenceBlocks, layer: int, num_tokens: int) -> int:
        """Free layer ``layer``'s blocks past the first ``num_tokens`` tokens (re-compression); returns how
        many blocks were freed."""
        table = blocks.tables[layer]
        keep = ceil_div(num_tokens, self.block_size)
        gone = table[keep:]
        del table[keep:]
        self._used.difference_update(gone)
        self._free.extend(reversed(gone))
        return len(gone)

    def free(self, blocks: SequenceBlocks) -> None:
        """Return a sequence's blocks; freeing a block that is not in use is a bug and raises.

        ``blocks.tables`` is rebound to empty tables; the old table lists are left as they were, so a
        caller that kept them (a swap-out) can still read the K/V before the blocks are written again."""
        ids = [b for t in blocks.tables for b in t]
        if len(set(ids)) != len(ids) or not self._used.issuperset(ids):
            raise RuntimeError("freeing blocks that are not allocated (double free)")
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))
        blocks.tables = [[] for _ in blocks.tables]

    # -- admission -----------------------------------------------------------------------------------
    @property
    def reserves_new_tokens(self) -> bool:
        return self.policy.reserve

    def admit_need(self, layer_lengths: list[int], max_new_tokens: int) -> int:
        """Blocks a cache of ``layer_lengths`` takes at admission."""
        return self.blocks_needed(layer_lengths, max_new_tokens if self.policy.reserve else 0)

    def admit_room(self, swapped: int = 0) -> int:
        """Blocks a new cache may take now (idle ones count); none while ``swapped`` preempted sequences wait
        to resume."""
        if swapped:
            return 0
        return max(0, self.num_free + self.num_idle - self.policy.watermark_blocks)

    def refusal(
        self, layer_lengths: list[int], max_new_tokens: int, swapped: int = 0
    ) -> AdmissionRefusal | None:
        """Why a cache of ``layer_lengths`` cannot be admitted now, or None if it can."""
        most = self.blocks_needed(layer_lengths, max_new_tokens)
        if most > self.num_blocks:
            return AdmissionRefusal(
                RefusalKind.NEVER_FITS,
                f"request needs up to {most} KV blocks with max_new_tokens={max_new_tokens}; "
                f"the pool has {self.num_blocks}",
            )
        need, room = self.admit_need(layer_lengths, max_new_tokens), self.admit_room(swapped)
        if need > room:
            return AdmissionRefusal(
                RefusalKind.POOL_FULL,
                f"KV pool full: request needs {need} blocks, {room} available "
                f"({self.num_free} free, {self.num_idle} idle, {swapped} preempted sequences waiting)",
            )
        return None

    def admit(
        self, layer_lengths: list[int], max_new_tokens: int, swapped: int = 0
    ) -> SequenceBlocks | AdmissionRefusal:
        """Take a new cache's blocks under the admission policy, or say why not (nothing taken)."""
        refused = self.refusal(layer_lengths, max_new_tokens, swapped)
        if refused is not None:
            return refused
        blocks = self.allocate(layer_lengths, max_new_tokens if self.policy.reserve else 0)
        assert blocks is not None, "admit_room never exceeds num_free"
        return blocks
