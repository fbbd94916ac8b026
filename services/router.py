"""Chooses workers for a request: a decode worker with room in its KV pool, and a prefill worker (one
holding the request's images in its image cache, unless it is much busier than the least-loaded one).

The router only wires its parts, each small and tested alone (as NVIDIA Dynamo's KV router splits
publisher, indexer and scheduler):

- ``load_watch.py`` ``LoadWatch``: keeps each worker's last pushed report current (``WatchLoad``
  streams, re-opened after a break; polls for workers without one);
- ``load_board.py`` ``LoadBoard``, one per pool: the reports, their freshness, the sampling list, and
  the reservations (``reserve`` at a pick, ``Reservation.settle`` when the cache arrived);
- ``image_index.py`` ``ImageIndex``: which prefill worker holds which image;
- ``prefix_index.py`` ``PrefixIndex``: which prefill worker was sent which prompt prefix (a conversation's
  follow-up goes there: it prefills only its new tokens);
- ``kept_turns.py`` ``KeptTurns``: which decode worker kept which conversation turn's cache (an unverified
  ``continue`` follow-up is decoded there, with no prefill);
- ``strategies.py``: the picks, pure functions of the candidates and the request, in one table;
- ``admission_queue.py`` ``AdmissionQueue``: requests waiting for a decode worker with room.

A pick costs the same at 10 or 1,000 workers (``strategy="kv"``, the default): best-of-k sampling over
the workers with a fresh report (``SAMPLE_K`` drawn, up to ``STRATEGIES["kv"].rounds`` draws). Prefill
picks also look at a worker with nothing in flight from this gateway, if there is one (join the idle
queue). Several gateways may route over the same workers: each keeps its own reservations, and a race lost
to another gateway ends in a refusal and a re-queue, never a lost request.
"""

from __future__ import annotations

import asyncio
import random

import grpc
from vlkv.common.errors import ResourceExhausted, Unavailable
from vlkv.common.grpc_server import make_channel
from vlkv.common.security import SecurityConfig
from vlkv.services.admission_queue import AdmissionQueue
from vlkv.services.image_index import ImageIndex
from vlkv.services.kept_turns import KeptTurns
from vlkv.services.load_board import DROP_S, STALE_S, LoadBoard, Reservation, Worker
from vlkv.services.load_watch import POLL_S, LoadWatch
from vlkv.services.prefix_index import PrefixIndex
from vlkv.services.strategies import BUSY_MARGIN, STRATEGIES, Need, pick_prefill
from vlkv.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["BUSY_MARGIN", "DROP_S", "POLL_S", "STALE_S", "STRATEGIES", "Reservation", "Router", "Worker"]
SAMPLE_K = 4  # workers drawn per pick


def grpc_connect(router: Router, address: str, kind: str) -> tuple[grpc.aio.Channel, object]:
    """A channel to a worker and its stub (the default ``Router.connect``)."""
    ch = make_channel(address, router.security, router.max_message_bytes, router.keepalive_s)
    stub_cls = worker_pb2_grpc.PrefillWorkerStub if kind == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    return ch, stub_cls(ch)


class Router:
    def __init__(
        self,
        max_message_bytes: int = 64 << 20,
        security=None,
        keepalive_s: float = 0.0,
        *,
        strategy: str = "kv",
        sample_k: int = SAMPLE_K,
        seed: int | None = None,
        connect=grpc_connect,
    ) -> None:
        """``connect(router, address, kind) -> (channel, stub)`` reaches a worker (``vlkv simulate`` passes
        simulated workers); ``strategy``: a name in ``strategies.STRATEGIES``."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s  # pings on every worker channel (grpc_server.keepalive_options)
        self.security = security if security is not None else SecurityConfig()
        self.strategy = STRATEGIES[strategy]
        self.windows: tuple[int, ...] = ()  # the model's sliding windows (ModelSpec.windows): decode rings
        self.sample_k = sample_k
        self.rng = random.Random(seed)
        self.connect = connect
        self.prefill = LoadBoard(idle=True)
        self.decode = LoadBoard()
        self.images = ImageIndex()
        self.prefixes = PrefixIndex()
        self.kept = KeptTurns()  # which decode worker kept which conversation turn's cache
        self.queue = AdmissionQueue()
        self.watch = LoadWatch(self._on_report)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a decode worker with room."""
        return len(self.queue)

    # -- membership and reports ----------------------------------------------------------------------
    def add_prefill(self, address: str) -> None:
        self._add(self.prefill, address, "prefill")

    def add_decode(self, address: str) -> None:
        self._add(self.decode, address, "decode")

    def _add(self, board: LoadBoard, address: str, kind: str) -> None:
        if address not in board:
            w = Worker(address, *self.connect(self, address, kind))
            board.join(w)
            self.watch.start(w, board)

    async def remove(self, address: str) -> None:
        self.images.forget(address)
        self.prefixes.forget(address)
        self.kept.forget(address)
        for board in (self.prefill, self.decode):
            w = board.leave(address)
            if w is not None:
                if w.watcher is not None:
                    w.watcher.cancel()
                if w.channel is not None:
                    await w.channel.close()

    async def close(self) -> None:
        for address in list(self.prefill) + list(self.decode):
            await self.remove(address)

    def set_draining(self, address: str) -> None:
        for board in (self.prefill, self.decode):
            if address in board:
                board[address].draining = True

    def _on_report(self, board: LoadBoard, w: Worker, load: worker_pb2.WorkerLoad) -> None:
        board.report(w, load, asyncio.get_running_loop().time())
        if board is self.prefill:
            self.images.report(w.address, load)

    async def poll_all(self) -> None:
        """Ask every worker's load now (`vlkv status`); routing and autoscaling use the pushed reports."""
        await self.watch.poll_all([(w, b) for b in (self.prefill, self.decode) for w in list(b.values())])

    def note_refusal(self, w: Worker) -> None:
        """``w`` refused a cache for room (``REFUSAL_POOL_FULL``): its last report overstates its room, so it
        is not picked again until it reports again."""
        w.refused = True

    def note_lost(self, w: Worker) -> None:
        """``w`` failed a request before its first token (the hand-off could not reach it, or its stream
        broke): out of the decode draw until it reports again, so the one retry goes to another worker while
        its last report still looks fresh. A worker that is in fact alive is back at its next report (or at
        the poll a pick makes when no worker is left in the draw)."""
        if self.decode.holds(w):
            self.decode.lost(w)

    def note_images(self, address: str, images: tuple[str, ...], tenant: str = "") -> None:
        """``address`` prefilled these images (it holds them in its image cache now)."""
        self.images.note(address, images, tenant)

    def note_prefix(self, address: str, keys: tuple[str, ...]) -> None:
        """``address`` prefilled a prompt of these blocks (``prefix_index.route_keys``)."""
        self.prefixes.note(address, keys)

    # -- prefill ---------------------------------------------------------------------------------------
    def pick_prefill(
        self,
        exclude: set[str] = frozenset(),
        images: tuple[str, ...] = (),
        tenant: str = "",
        prefix: tuple[str, ...] = (),
    ) -> Worker:
        """The serving prefill worker that was sent the longest of the prompt's ``prefix`` blocks, or else
        holds most of ``images`` (of ``tenant``), if it is not much busier than the least-loaded one
        (``BUSY_MARGIN``); else the least-loaded one of those drawn."""
        self.watch.start_pending()
        board = self.prefill
        if self.strategy.draw == "poll" or len(board) <= self.sample_k:
            drawn = list(board.values())
        else:
            now = asyncio.get_running_loop().time()
            drawn = self._idle_prefill(board, now, exclude)
            drawn += [w for w in board.draw(self.rng, self.sample_k) if board.fresh(w, now)]
            if not drawn or all(w.address in exclude or w.draining for w in drawn):
                drawn = list(board.values())  # a retry that excluded the draw, or no fresh report
        live = [w for w in drawn if not w.draining and w.address not in exclude]
        held = {board[a]: n for a, n in self.images.held(images, tenant).items() if a in board}
        address, blocks = self.prefixes.longest(prefix) if prefix else ("", 0)
        if address in board:  # a prefix holds the images before it too: it outranks them
            held = {
                board[address]: blocks + len(images),
                **{w: n for w, n in held.items() if w.address != address},
            }
        holders = {
            w: n for w, n in held.items() if w.reachable and not w.draining and w.address not in exclude
        }
        w = pick_prefill(live, holders)
        if w is None:
            raise Unavailable("no prefill worker is available")
        return w

    def _idle_prefill(self, board: LoadBoard, now: float, exclude) -> list[Worker]:
        """A serving prefill worker with nothing in flight from this gateway, if one is at hand (join the
        idle queue: at most ``sample_k`` looked at)."""
        idle, skipped, found = board.idle, [], []
        while idle and len(skipped) < self.sample_k:
            w = idle.pop()
            skipped.append(w)
            if not w.draining and w.address not in exclude and w.reachable and board.fresh(w, now):
                found.append(w)
                break
        idle.update(w for w in skipped if w.in_flight == 0 and w.idle is idle)
        return found

    # -- decode ----------------------------------------------------------------------------------------
    async def pick_decode(
        self, layer_tokens: list[int], max_new_tokens: int, wait_s: float = 0.0, max_waiting: int = 0
    ) -> Reservation:
        """A decode worker that can admit a cache of ``layer_tokens`` now, with the blocks reserved for it
        (settle the reservation when the cache has arrived or never will).

        When none can, the request waits in a first-come-first-served queue of at most ``max_waiting``
        requests for up to ``wait_s``; then RESOURCE_EXHAUSTED. A request larger than every worker's whole
        pool is refused at once."""
        self.watch.start_pending()
        return await self.queue.admit(
            lambda: self._try_decode(layer_tokens, max_new_tokens), wait_s, max_waiting
        )

    async def _try_decode(self, layer_tokens: list[int], max_new_tokens: int) -> Reservation | None:
        board, strategy = self.decode, self.strategy
        if not board:
            raise Unavailable("no decode worker is registered")
        if not board.live and strategy.draw != "poll":  # none reported lately (a gateway just started): ask
            await self.watch.poll_all([(w, board) for w in list(board.values())[: self.sample_k]])
        need = Need(layer_tokens, max_new_tokens, self.windows)
        loop = asyncio.get_running_loop()
        for _ in range(strategy.rounds * (self.sample_k if strategy.per_k else 1)):
            drawn = await self._draw(board, strategy.draw)
            largest = board.largest
            if largest is not None and largest.total_blocks < need.blocks(largest, whole=True):
                raise ResourceExhausted(
                    f"this request (max_new_tokens={max_new_tokens}) needs more KV blocks than a decode worker holds"
                )
            now = loop.time()
            w = strategy.pick([w for w in drawn if board.usable(w, now)], need)
            if w is not None:
                return board.reserve(w, need.blocks(w.load))
            if len(board.live) <= len(drawn):
                break  # every worker was looked at
        if not board.live:
            raise Unavailable("no decode worker is reachable")
        return None

    async def _draw(self, board: LoadBoard, how: str) -> list[Worker]:
        if how == "poll":  # every worker's load now
            workers = list(board.values())
            loads = await self.watch.poll_all([(w, board) for w in workers])
            return [w for w, load in zip(workers, loads, strict=True) if load is not None]
        if how == "next":
            return board.draw_next()
        drawn = board.draw(self.rng, {"sample": self.sample_k, "two": 2, "one": 1}[how])
        if any(w.polled for w in drawn):  # workers without a load stream: their load now
            await self.watch.poll_all([(w, board) for w in drawn if w.polled])
        return drawn
