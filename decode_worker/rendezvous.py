"""Where a request's cache (from ``TransferKV``/``TransferKVNixl``) meets its ``Decode`` call, in either order.

One object per decode worker, used on its event loop only. The three parties and their verbs:

- a transfer: ``begin_transfer(rid, transfer)`` when its header is admitted (a newer transfer of the same id
  supersedes an unfinished one), ``end_transfer`` when it ends either way, ``deliver(seq, sender)`` once the
  cache is whole in the pool;
- a ``Decode`` call: ``claim(rid, wait_s)`` returns the sequence (or waits for it), ``abandon(rid)`` when the
  call ends without one (client cancel, deadline);
- the worker: ``expire_all()`` / ``fail_waiters(exc)`` at shutdown or when the decode loop died.

Blocks are never held for nobody: a cache delivered after its ``Decode`` call gave up is freed at once; an
abandoned request's transfer still in flight is aborted (``transfer.abandon()``, which frees its blocks as
soon as no write can still land); a cache nobody claims is freed after ``unclaimed_lease_s`` (short: the
gateway opens ``Decode`` before the prefill starts, so a real cache finds its caller waiting), and one
sender may park at most ``max_unclaimed_per_sender`` such caches at a time (``may_park``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc
from vlkv.common.errors import VlkvError
from vlkv.common.handoff.transport import Transfer

log = logging.getLogger(__name__)
ABANDONED_MAX = 4096  # remembered abandoned ids (each for the claim wait); older ones are dropped first


class HasRequestId(Protocol):
    request_id: str


S = TypeVar("S", bound=HasRequestId)


@dataclass
class _Parked(Generic[S]):
    seq: S
    lease: asyncio.TimerHandle
    sender: str


class Rendezvous(Generic[S]):
    def __init__(
        self,
        free: Callable[[S], None],
        *,
        claim_wait_s: float,
        unclaimed_lease_s: float,
        max_unclaimed_per_sender: int,
    ) -> None:
        """``free(seq)`` returns an unclaimed sequence's blocks to the pool; ``claim_wait_s``: how long a
        ``Decode`` call waits by default (and how long an abandoned id is remembered)."""
        self._free = free
        self.claim_wait_s = claim_wait_s
        self.unclaimed_lease_s = unclaimed_lease_s
        self.max_unclaimed_per_sender = max_unclaimed_per_sender
        self._parked: dict[str, _Parked[S]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._transfers: dict[str, Transfer] = {}
        self._superseded: set[int] = set()  # id() of transfers a newer one replaced
        self._abandoned: dict[str, float] = {}  # request id -> monotonic time it is forgotten

    # -- counters ------------------------------------------------------------------------------------
    @property
    def num_unclaimed(self) -> int:
        return len(self._parked)

    @property
    def num_transfers(self) -> int:
        return len(self._transfers)

    def unclaimed_of(self, sender: str) -> int:
        return sum(1 for p in self._parked.values() if p.sender == sender)

    # -- transfers -----------------------------------------------------------------------------------
    def check_new(self, rid: str) -> None:
        """Raise unless a cache for ``rid`` may be admitted now (before any block is taken)."""
        if rid in self._parked:
            raise VlkvError(f"a cache for {rid!r} is already here", grpc.StatusCode.ALREADY_EXISTS)
        if self.abandoned(rid):
            raise VlkvError(f"request {rid!r} was cancelled", grpc.StatusCode.CANCELLED)

    def may_park(self, rid: str, sender: str) -> bool:
        """Whether ``sender`` may hand over a cache for ``rid`` now: always when its ``Decode`` call waits,
        else only while the sender parks fewer than ``max_unclaimed_per_sender`` unclaimed caches."""
        return rid in self._waiters or self.unclaimed_of(sender) < self.max_unclaimed_per_sender

    def begin_transfer(self, rid: str, transfer: Transfer) -> None:
        earlier = self._transfers.get(rid)
        if earlier is not None and earlier is not transfer:  # a retried prefill: its first sender died
            log.warning("request %s: a new transfer supersedes an unfinished one", rid)
            self._superseded.add(id(earlier))
        self._transfers[rid] = transfer

    def superseded(self, transfer: Transfer) -> bool:
        return id(transfer) in self._superseded

    def end_transfer(self, rid: str, transfer: Transfer) -> None:
        if self._transfers.get(rid) is transfer:
            del self._transfers[rid]
        self._superseded.discard(id(transfer))

    # -- arrival -------------------------------------------------------------------------------------
    def deliver(self, seq: S, sender: str = "") -> bool:
        """Hand a whole cache to its ``Decode`` call (now, or when it comes within the unclaimed lease).
        Returns False when the request was abandoned: the sequence was freed at once."""
        rid = seq.request_id
        waiter = self._waiters.get(rid)
        if waiter is not None and not waiter.done():
            waiter.set_result(seq)
            return True
        if self.abandoned(rid):
            log.info("request %s: cache arrived after its Decode call ended; freed", rid)
            self._free(seq)
            return False
        lease = asyncio.get_running_loop().call_later(self.unclaimed_lease_s, self._expire, rid)
        self._parked[rid] = _Parked(seq, lease, sender)
        return True

    def _expire(self, rid: str) -> None:
        parked = self._parked.pop(rid, None)
        if parked is not None:
            parked.lease.cancel()
            log.warning("request %s: cache not claimed within its lease; freed", rid)
            self._free(parked.seq)

    def expire_all(self) -> None:
        for rid in list(self._parked):
            self._expire(rid)

    # -- Decode calls --------------------------------------------------------------------------------
    async def claim(self, rid: str, wait_s: float | None = None) -> S:
        """The sequence of ``rid``, waiting up to ``wait_s`` (default ``claim_wait_s``) for its cache;
        DEADLINE_EXCEEDED if it does not come, ALREADY_EXISTS if another call waits for it."""
        parked = self._parked.pop(rid, None)
        if parked is not None:
            parked.lease.cancel()
            return parked.seq
        if rid in self._waiters:
            raise VlkvError(f"request {rid!r} is already being decoded", grpc.StatusCode.ALREADY_EXISTS)
        self._abandoned.pop(rid, None)  # a new call for the id: it is wanted again
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            return await asyncio.wait_for(fut, wait_s or self.claim_wait_s)
        except asyncio.TimeoutError:
            raise VlkvError(
                f"the cache of request {rid!r} did not arrive in time", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None
        finally:
            if self._waiters.get(rid) is fut:
                del self._waiters[rid]

    def abandon(self, rid: str) -> None:
        """The ``Decode`` call of ``rid`` ended without its cache: free it whenever it arrives, and abort
        a transfer of it that is still in flight."""
        now = time.monotonic()
        self._abandoned[rid] = now + self.claim_wait_s
        while len(self._abandoned) > ABANDONED_MAX:
            del self._abandoned[next(iter(self._abandoned))]
        transfer = self._transfers.get(rid)
        if transfer is not None:
            transfer.abandon()

    def abandoned(self, rid: str) -> bool:
        until = self._abandoned.get(rid)
        if until is None:
            return False
        if until < time.monotonic():
            del self._abandoned[rid]
            return False
        return True

    def fail_waiters(self, exc: BaseException) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
