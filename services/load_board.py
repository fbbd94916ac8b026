"""The router's view of one pool of workers (prefill or decode): each worker's last pushed load report,
how fresh it is, and the router's own accounting on top (requests in flight from this gateway, KV blocks
promised to requests whose caches are still on their way).

A report comes in (``report``) from the worker's load stream or a poll (``load_watch.py``). A worker whose
report is older than ``STALE_S`` is not routed on; older than ``DROP_S``, or whose stream broke (``lost``),
it leaves the sampling list (``live``, O(1) draws at any size) until it reports again.

Reservations, one pair: ``reserve`` promises blocks on a decode worker when it is picked; the request's
``Reservation.settle`` says its cache arrived (or never will). A settled promise still counts until the
worker's next report, which then counts the cache itself: a report sent before the cache arrived would
show its room free and let a second request through (a8156be).
"""

from __future__ import annotations

import random

from vlkv.v1 import worker_pb2

STALE_S = 3.0  # a report older than this is not routed on (workers report at least every second)
DROP_S = 10.0  # a worker silent this long leaves the sampling list until it reports again


class Worker:
    """One worker as a gateway sees it: how to reach it, its last report, and this gateway's accounting."""

    __slots__ = (
        "address", "channel", "stub", "_in_flight", "idle", "draining", "reachable", "load", "load_at",
        "failed", "polled", "refused", "index", "watcher", "promised", "settling",
    )  # fmt: skip

    def __init__(self, address: str, channel=None, stub=None, in_flight: int = 0) -> None:
        self.address, self.channel, self.stub = address, channel, stub
        self.idle: set | None = None  # prefill: its board's set of workers with nothing in flight
        self._in_flight = in_flight  # requests this gateway has on the worker now
        self.draining = False  # takes no new requests; removed once nothing is in flight
        self.reachable = True
        self.load = worker_pb2.WorkerLoad()
        self.load_at = float("-inf")  # event-loop time of the last report
        self.failed = False  # its load stream or poll failed since its last report
        self.polled = False  # offers no WatchLoad: asked with GetLoad when drawn (and every POLL_S)
        self.refused = False  # refused a cache for room since its last report: not picked until the next
        self.index = -1  # position in its board's sampling list (-1: not in it)
        self.watcher = None  # the task keeping its report current
        self.promised = 0  # decode: blocks reserved for caches on their way (``reserve``)
        self.settling = 0  # of those, settled: released by the next report

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:  # the gateway counts its requests here; the idle set follows
        self._in_flight = n
        if self.idle is not None:
            (self.idle.discard if n else self.idle.add)(self)

    @property
    def room(self) -> int:
        """Blocks it would admit now: reported admissible, less those promised since."""
        return self.load.admit_blocks - self.promised

    @property
    def free(self) -> int:
        return self.load.free_blocks - self.promised

    def __repr__(self) -> str:
        return f"Worker({self.address!r}, in_flight={self._in_flight}, promised={self.promised})"


class Reservation:
    """Blocks promised to one request on a decode worker, from its pick until the worker's next report
    after ``settle``."""

    __slots__ = ("worker", "blocks")

    def __init__(self, worker: Worker, blocks: int) -> None:
        self.worker, self.blocks = worker, blocks

    def settle(self) -> None:
        """The cache arrived, or never will; idempotent. The promise lasts until the worker's next report."""
        self.worker.settling += self.blocks
        self.blocks = 0


class LoadBoard(dict):
    """address -> Worker for one pool, plus the workers that reported lately (``live``) for O(1) draws."""

    def __init__(self, idle: bool = False) -> None:
        super().__init__()
        self.live: list[Worker] = []
        self.next = 0  # round robin
        self.idle: set[Worker] | None = set() if idle else None  # nothing in flight (join the idle queue)
        self.largest: worker_pb2.WorkerLoad | None = None  # a report of the largest pool seen

    def join(self, w: Worker) -> None:
        self[w.address] = w
        if self.idle is not None:
            w.idle = self.idle
            w.in_flight = w.in_flight  # enters the idle set if nothing is in flight

    def leave(self, address: str) -> Worker | None:
        w = self.pop(address, None)
        if w is not None:
            self._delist(w)
            if self.idle is not None:
                self.idle.discard(w)
            w.idle = None
        return w

    def holds(self, w: Worker) -> bool:
        return self.get(w.address) is w

    # -- reports ---------------------------------------------------------------------------------------
    def report(self, w: Worker, load: worker_pb2.WorkerLoad, now: float) -> None:
        """A report from ``w``: it counts the caches that arrived before it, so settled promises end."""
        w.load, w.load_at = load, now
        w.promised -= w.settling
        w.settling = 0
        w.reachable, w.failed, w.refused = True, False, False
        if self.holds(w):
            self._enlist(w)
        if load.total_blocks and (self.largest is None or load.total_blocks >= self.largest.total_blocks):
            self.largest = load

    def lost(self, w: Worker) -> None:
        """Its load stream or poll failed: out of the sampling list until it reports again."""
        w.reachable, w.failed = False, True
        self._delist(w)

    def fresh(self, w: Worker, now: float) -> bool:
        """``w`` reported within ``STALE_S``; one silent for ``DROP_S`` leaves the sampling list."""
        age = now - w.load_at
        if age > DROP_S:
            self._delist(w)
            w.reachable = False
        return age <= STALE_S

    def usable(self, w: Worker, now: float) -> bool:
        """Takes new requests and has a fresh report."""
        return not (w.draining or w.load.draining) and self.fresh(w, now)

    # -- reservations ----------------------------------------------------------------------------------
    def reserve(self, w: Worker, blocks: int) -> Reservation:
        """Promise ``blocks`` of ``w``'s room to a request picked for it (no await since the room was read:
        the promise is atomic on this event loop)."""
        w.promised += blocks
        return Reservation(w, blocks)

    # -- draws -----------------------------------------------------------------------------------------
    def draw(self, rng: random.Random, k: int) -> list[Worker]:
        live = self.live
        return list(live) if len(live) <= k else rng.sample(live, k)

    def draw_next(self) -> list[Worker]:
        """Round robin over the sampling list."""
        if not self.live:
            return []
        self.next = (self.next + 1) % len(self.live)
        return [self.live[self.next]]

    def _enlist(self, w: Worker) -> None:
        if w.index < 0:
            w.index = len(self.live)
            self.live.append(w)

    def _delist(self, w: Worker) -> None:
        i = w.index
        if i < 0:
            return
        last = self.live.pop()
        if last is not w:
            self.live[i] = last
            last.index = i
        w.index = -1
