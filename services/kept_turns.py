"""Which decode worker kept which conversation turn's cache, as this gateway knows it (``KeptTurns``).

An unverified ``continue`` turn is decoded with a ``retain_key``; the decode worker that kept its cache says
so when the turn ends (the trailing metadata ``vlkv-retained``: the positions it holds). The gateway notes
the token ids those positions stand for: the turn's prompt and the tokens it produced but the last (that one
never went in). A later ``continue`` prompt of the same tenant that starts with a kept turn's first prompt
and goes past it (the same images, no new one: decode steps cannot feed an image) is decoded there: the
positions it shares with the kept ids stay, the rest of the prompt is fed (``worker.proto`` ``ContinueFrom``).
The first turn's prompt (``full_from`` positions, compressed) must match exactly; the answers after it are
cached whole, so the cache is cut back to where the prompt stops agreeing with them.

Keys are drawn here (random, 32 hex digits), so a tenant can name no other tenant's cache, and entries are
per tenant. A hint only: the worker may have given the blocks back (FAILED_PRECONDITION), and the turn is then
served the usual way. Bounded in entries and in the token ids they hold (``MAX_KEPT_IDS``, stored as uint32):
the least recently noted entries are forgotten first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

MAX_KEPT_TURNS = 1 << 14  # entries a gateway remembers
MAX_KEPT_IDS = 1 << 25  # token ids they hold together (4 bytes each: 128 MiB)


@dataclass(frozen=True)
class KeptTurn:
    key: str  # the retain_key the worker kept it under
    address: str  # the decode worker
    tenant: str
    ids: Sequence[int]  # the token ids at positions 0 .. len(ids)-1 of the kept cache (stored as uint32)
    full_from: int  # positions from here on may be dropped (the first turn's prompt length)
    prompt_tokens: int  # the kept turn's own prompt
    images: tuple[str, ...] = ()  # the digests of its images (the gateway's, of their pixel values)


def _hasher(images: Sequence[str] = ()):
    h = hashlib.blake2b(digest_size=16, person=b"vlkv-kept-turn")
    h.update(len(images).to_bytes(4, "little") + "\0".join(images).encode() + b"\0")
    return h


def _pack(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


def _digest(ids: Sequence[int], images: Sequence[str]) -> bytes:
    h = _hasher(images)
    h.update(_pack(ids))
    return h.digest()


def _shared(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """How many leading ids ``a`` and ``b`` share, given that the first ``start`` agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KeptTurns:
    def __init__(self, capacity: int = MAX_KEPT_TURNS, max_ids: int = MAX_KEPT_IDS) -> None:
        self.capacity = capacity
        self.max_ids = max_ids
        self._ids = 0  # token ids held, all entries
        self._turns: OrderedDict[str, KeptTurn] = OrderedDict()  # key -> turn, least recently noted first
        self._by_root: dict[tuple[str, int, bytes], set[str]] = {}  # (tenant, full_from, digest) -> keys
        self._lengths: dict[str, dict[int, int]] = {}  # tenant -> full_from -> entries

    def __len__(self) -> int:
        return len(self._turns)

    def note(self, turn: KeptTurn) -> None:
        if not 0 < turn.full_from <= len(turn.ids) <= self.max_ids:
            return
        turn = replace(turn, ids=array("I", turn.ids))  # 4 bytes an id, not a Python int's 28 + 8
        self.drop(turn.key)
        self._turns[turn.key] = turn
        self._ids += len(turn.ids)
        self._by_root.setdefault(self._root(turn), set()).add(turn.key)
        lengths = self._lengths.setdefault(turn.tenant, {})
        lengths[turn.full_from] = lengths.get(turn.full_from, 0) + 1
        while len(self._turns) > self.capacity or self._ids > self.max_ids:
            self.drop(next(iter(self._turns)))

    def find(
        self, tenant: str, ids: Sequence[int], images: Sequence[str] = ()
    ) -> tuple[KeptTurn, int] | None:
        """The kept turn a prompt of ``ids`` showing ``images`` continues, and the positions to keep; None:
        none. It continues a turn of the same tenant and images (a new image cannot be fed by decode steps)
        whose whole prompt it starts with, and goes past; of those, the one sharing the most positions. At
        most ``len(ids) - 1`` are kept: one prompt token at least is fed, to sample from."""
        best: tuple[KeptTurn, int] | None = None
        images = tuple(images)
        running, done = _hasher(images), 0  # the digest of ids[:full_from], grown length by length
        for full_from in sorted(self._lengths.get(tenant, {})):
            if full_from >= len(ids):
                break
            running.update(_pack(ids[done:full_from]))
            done = full_from
            for key in self._by_root.get((tenant, full_from, running.copy().digest()), ()):
                turn = self._turns[key]
                keep = min(_shared(ids, turn.ids, full_from), len(ids) - 1)
                if keep >= turn.prompt_tokens and (best is None or keep > best[1]):
                    best = (turn, keep)
        return best

    def drop(self, key: str) -> KeptTurn | None:
        turn = self._turns.pop(key, None)
        if turn is None:
            return None
        self._ids -= len(turn.ids)
        root = self._root(turn)
        keys = self._by_root.get(root)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_root[root]
        lengths = self._lengths[turn.tenant]
        lengths[turn.full_from] -= 1
        if not lengths[turn.full_from]:
            del lengths[turn.full_from]
            if not lengths:
                del self._lengths[turn.tenant]
        return turn

    def forget(self, address: str) -> None:
        """The worker left: none of its turns count."""
        for key in [k for k, t in self._turns.items() if t.address == address]:
            self.drop(key)

    @staticmethod
    def _root(turn: KeptTurn) -> tuple[str, int, bytes]:
        return (turn.tenant, turn.full_from, _digest(turn.ids[: turn.full_from], turn.images))
