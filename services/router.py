"""Chooses workers for a request: a prefill worker (one holding the request's images in its image cache, unless
it is much busier than the least-loaded one), a decode worker with room in its KV pool.

Load is pushed, not polled per request: every worker streams its load to the gateway (``WatchLoad``: a
report at once, on change and at least every second; a worker without it is polled every ``POLL_S``), and
the router keeps each worker's last report (``on_load``). On top of it the router keeps its own
accounting: requests in flight per worker and, per decode worker, the blocks promised to requests whose
caches are still on their way (``DecodeSlot``), as NVIDIA Dynamo's KV router does.

A pick costs the same at 10 or 1,000 workers (``strategy="kv"``, the default): best-of-k sampling over the
workers with a fresh report. Decode: ``SAMPLE_K`` workers drawn at random (up to ``SAMPLE_ROUNDS`` draws);
of those that are not draining and whose room (admissible blocks reported, less the blocks promised since)
covers the request's estimated blocks per layer, the one with the most room. None: the request waits in
the admission queue. Prefill: the worker holding most of the request's images (learned from the workers'
reports of image-cache entries added and evicted, and from this gateway's own prefills) unless it has more
than ``BUSY_MARGIN`` requests in flight beyond the least-loaded of a worker with nothing in flight (the
router keeps the set of them: join the idle queue) and ``SAMPLE_K`` drawn workers.

A worker that offers no ``WatchLoad`` (an older build) is also asked its load when drawn. A worker whose
last report is older than ``STALE_S`` is skipped; older than ``DROP_S``, or whose stream
broke, it leaves the sampling set until it reports again. Other strategies, for comparison (``vlkv
simulate``): ``poll`` (today's before: ask every decode worker's ``GetLoad`` per pick, take the most room),
``best2`` (two drawn, the more free blocks, no fit check), ``random`` and ``round_robin`` (no fit check).
Without the fit check a full worker refuses the cache (``REFUSAL_POOL_FULL``) and the gateway re-queues.

Several gateways may route over the same workers: each keeps its own reservations, and a race lost to
another gateway ends in a refusal and a re-queue, never a lost request.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import grpc
from vlkv.common.errors import ResourceExhausted, Unavailable
from vlkv.common.grpc_server import make_channel
from vlkv.common.reuse import ANONYMOUS
from vlkv.common.security import SecurityConfig
from vlkv.decode_worker.block_manager import blocks_needed
from vlkv.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 2.0
ADMIT_POLL_S = 0.02  # how often the head of the admission queue looks for a decode worker with room again
BUSY_MARGIN = 2  # a holder of the images is "much busier" with more than this many extra requests in flight
MAX_IMAGE_HOLDERS = 65536  # (tenant, image hash) -> prefill worker entries the gateway remembers
SAMPLE_K = 4  # workers drawn per pick
SAMPLE_ROUNDS = 2  # draws before a decode pick gives up and queues
STALE_S = 3.0  # a report older than this is not routed on (workers report at least every second)
DROP_S = 10.0  # a worker silent this long leaves the sampling set until it reports again
POLL_S = 0.25  # a worker without WatchLoad is polled this often
RETRY_S = 0.5  # a broken load stream is opened again after this (doubling up to RETRY_MAX_S)
RETRY_MAX_S = 5.0
STRATEGIES = ("kv", "poll", "best2", "random", "round_robin")


@dataclass(eq=False)
class Worker:
    address: str
    channel: grpc.aio.Channel | None
    stub: object
    in_flight: int = 0  # requests the gateway has on this worker now
    idle: set | None = None  # prefill: its pool's set of workers with nothing in flight from this gateway
    draining: bool = False  # takes no new requests; removed once in_flight reaches 0
    reachable: bool = True
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)
    pending_blocks: int = 0  # decode: blocks promised to requests whose cache has not arrived yet
    settling_blocks: int = 0  # decode: of those, arrived but not yet in a report: released by the next one
    load_at: float = float("-inf")  # event-loop time of the last report
    failed: bool = False  # its load stream or poll failed since its last report
    polled: bool = False  # offers no WatchLoad: asked with GetLoad when drawn (and every POLL_S)
    refused: bool = False  # refused a cache for room since its last report: not picked until the next
    index: int = -1  # position in its pool's sampling list (-1: not in it)
    watcher: asyncio.Task | None = None

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name == "in_flight" and self.__dict__.get("idle") is not None:  # keep the idle set current
            if value:
                self.idle.discard(self)
            else:
                self.idle.add(self)


@dataclass
class DecodeSlot:
    """A decode worker picked for a request, with the blocks promised to it until its cache arrives."""

    worker: Worker
    blocks: int

    def release(self) -> None:
        """The cache arrived or never will; idempotent. The promise is kept until the worker's next load
        report, which counts the cache (a report sent before the cache arrived would show its room free)."""
        self.worker.settling_blocks += self.blocks
        self.blocks = 0


class _Pool(dict):
    """address -> Worker, plus the list of workers that reported lately, for O(1) draws."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[Worker] = []
        self.next = 0  # round robin
        self.idle: set[Worker] = set()  # prefill: nothing in flight from this gateway (join the idle queue)

    def enlist(self, w: Worker) -> None:
        if w.index < 0:
            w.index = len(self.live)
            self.live.append(w)

    def delist(self, w: Worker) -> None:
        i = w.index
        if i < 0:
            return
        last = self.live.pop()
        if last is not w:
            self.live[i] = last
            last.index = i
        w.index = -1

    def draw(self, rng: random.Random, k: int) -> list[Worker]:
        live = self.live
        return list(live) if len(live) <= k else rng.sample(live, k)


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
        simulated workers); ``strategy``: one of ``STRATEGIES``."""
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s  # pings on every worker channel (grpc_server.keepalive_options)
        self.security = security if security is not None else SecurityConfig()
        self.strategy = strategy
        self.sample_k = sample_k
        self.rng = random.Random(seed)
        self.connect = connect
        self.prefill: _Pool = _Pool()
        self.decode: _Pool = _Pool()
        self._admit_queue: deque[object] = deque()  # requests waiting for a decode worker with room
        self._holders: OrderedDict[tuple[str, str], str] = OrderedDict()  # (tenant, image) -> address
        self._largest: worker_pb2.WorkerLoad | None = None  # a report of the largest decode pool seen
        self._unwatched: list[Worker] = []  # added before an event loop ran: watched from the first pick

    @property
    def num_queued(self) -> int:
        """Requests waiting for a decode worker with room."""
        return len(self._admit_queue)

    # -- membership and reports ----------------------------------------------------------------------
    def _add(self, pool: _Pool, address: str, kind: str) -> None:
        if address in pool:
            return
        ch, stub = self.connect(self, address, kind)
        w = pool[address] = Worker(address, ch, stub)
        if kind == "prefill":
            w.idle = pool.idle
            w.in_flight = 0
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._unwatched.append(w)
            return
        self._start_watch(w, pool)

    def _start_watch(self, w: Worker, pool: _Pool) -> None:
        w.watcher = asyncio.get_running_loop().create_task(self._watch(w, pool))

    def _watch_pending(self) -> None:
        while self._unwatched:
            w = self._unwatched.pop()
            pool = self.prefill if self.prefill.get(w.address) is w else self.decode
            if pool.get(w.address) is w:
                self._start_watch(w, pool)

    def add_prefill(self, address: str) -> None:
        self._add(self.prefill, address, "prefill")

    def add_decode(self, address: str) -> None:
        self._add(self.decode, address, "decode")

    async def remove(self, address: str) -> None:
        for pool in (self.prefill, self.decode):
            w = pool.pop(address, None)
            if w is not None:
                pool.delist(w)
                pool.idle.discard(w)
                w.idle = None
                if w.watcher is not None:
                    w.watcher.cancel()
                if w.channel is not None:
                    await w.channel.close()

    async def close(self) -> None:
        for address in list(self.prefill) + list(self.decode):
            await self.remove(address)

    def set_draining(self, address: str) -> None:
        for pool in (self.prefill, self.decode):
            if address in pool:
                pool[address].draining = True

    def on_load(self, w: Worker, load: worker_pb2.WorkerLoad) -> None:
        """A report from ``w`` (its load stream or a poll)."""
        w.load = load
        w.load_at = asyncio.get_running_loop().time()
        w.pending_blocks -= w.settling_blocks  # the report counts the caches that arrived before it
        w.settling_blocks = 0
        w.reachable, w.failed, w.refused = True, False, False
        pool = self.prefill if self.prefill.get(w.address) is w else self.decode
        if pool.get(w.address) is w:
            pool.enlist(w)
        if load.total_blocks and (self._largest is None or load.total_blocks >= self._largest.total_blocks):
            self._largest = load
        if load.images_full:
            for key in [k for k, a in self._holders.items() if a == w.address]:
                del self._holders[key]
        for d in load.images_evicted:
            key = (d.tenant or ANONYMOUS, d.image_hash)
            if self._holders.get(key) == w.address:
                del self._holders[key]
        if load.images_added:
            self._note(w.address, [(d.tenant or ANONYMOUS, d.image_hash) for d in load.images_added])

    def _lost(self, w: Worker) -> None:
        w.reachable, w.failed = False, True
        for pool in (self.prefill, self.decode):
            if pool.get(w.address) is w:
                pool.delist(w)

    async def _watch(self, w: Worker, pool: _Pool) -> None:
        """Keep ``w``'s last report: its load stream, opened again after a break; polls if it has none."""
        delay = RETRY_S
        while pool.get(w.address) is w:
            reports = 0
            try:
                async for load in w.stub.WatchLoad(worker_pb2.LoadRequest()):
                    self.on_load(w, load)
                    reports += 1
                    delay = RETRY_S
            except grpc.aio.AioRpcError as exc:
                log.debug("load stream of %s broke: %s", w.address, exc.code().name)
                if not reports and await self._poll(w) is not None:  # it answers, but streams no load
                    w.polled = True
                    await self._poll_forever(w, pool)
                    return
            self._lost(w)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _poll_forever(self, w: Worker, pool: _Pool) -> None:
        while pool.get(w.address) is w:
            await self._poll(w)
            await asyncio.sleep(POLL_S)

    async def _poll(self, w: Worker) -> worker_pb2.WorkerLoad | None:
        try:
            load = await w.stub.GetLoad(worker_pb2.LoadRequest(), timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s did not answer GetLoad: %s", w.address, exc.code().name)
            self._lost(w)
            return None
        self.on_load(w, load)
        return load

    async def poll_all(self) -> None:
        """Ask every worker's load now (`vlkv status`); routing and autoscaling use the pushed reports."""
        workers = list(self.prefill.values()) + list(self.decode.values())
        await asyncio.gather(*(self._poll(w) for w in workers))

    def _fresh(self, pool: _Pool, w: Worker, now: float) -> bool:
        """``w`` reported within ``STALE_S``; one silent for ``DROP_S`` leaves the sampling set."""
        age = now - w.load_at
        if age > DROP_S:
            pool.delist(w)
            w.reachable = False
        return age <= STALE_S

    def note_refusal(self, w: Worker) -> None:
        """``w`` refused a cache for room (``REFUSAL_POOL_FULL``): its last report overstates its room, so it
        is not picked again until it reports again."""
        w.refused = True

    # -- prefill ---------------------------------------------------------------------------------------
    def pick_prefill(
        self, exclude: set[str] = frozenset(), images: tuple[str, ...] = (), tenant: str = ""
    ) -> Worker:
        """The serving prefill worker that holds most of ``images`` (of ``tenant``) if it is not much busier
        than the least-loaded one (``BUSY_MARGIN``), else the least-loaded one (of ``SAMPLE_K`` drawn)."""
        self._watch_pending()
        pool = self.prefill
        if self.strategy == "poll" or len(pool) <= self.sample_k:
            drawn = list(pool.values())
        else:
            now = asyncio.get_running_loop().time()
            drawn = self._idle_prefill(pool, now, exclude)
            drawn += [w for w in pool.draw(self.rng, self.sample_k) if self._fresh(pool, w, now)]
            if not drawn or all(w.address in exclude or w.draining for w in drawn):
                drawn = list(pool.values())  # a retry that excluded the draw, or no fresh report
        live = [w for w in drawn if not w.draining and w.address not in exclude]
        if not live:
            raise Unavailable("no prefill worker is available")
        least = min(live, key=lambda w: (not w.reachable, w.in_flight))
        held: dict[str, int] = {}
        tenant = tenant or ANONYMOUS
        for image in images:
            address = self._holders.get((tenant, image))
            if address is not None:
                held[address] = held.get(address, 0) + 1
        holders = [pool[a] for a in held if a in pool]
        holders = [w for w in holders if w.reachable and not w.draining and w.address not in exclude]
        if holders:
            best = max(holders, key=lambda w: (held[w.address], -w.in_flight))
            if best.in_flight - least.in_flight <= BUSY_MARGIN:
                return best
        return least

    def _idle_prefill(self, pool: _Pool, now: float, exclude) -> list[Worker]:
        """A serving prefill worker with nothing in flight from this gateway, if one is at hand (join the
        idle queue: at most ``sample_k`` looked at)."""
        idle, skipped, found = pool.idle, [], []
        while idle and len(skipped) < self.sample_k:
            w = idle.pop()
            skipped.append(w)
            if not w.draining and w.address not in exclude and w.reachable and self._fresh(pool, w, now):
                found.append(w)
                break
        idle.update(w for w in skipped if w.in_flight == 0 and w.idle is idle)
        return found

    def note_images(self, address: str, images: tuple[str, ...], tenant: str = "") -> None:
        """``address`` prefilled these images (it holds them in its image cache now)."""
        tenant = tenant or ANONYMOUS
        self._note(address, [(tenant, image) for image in images])

    def _note(self, address: str, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            self._holders[key] = address
            self._holders.move_to_end(key)
        while len(self._holders) > MAX_IMAGE_HOLDERS:
            self._holders.popitem(last=False)

    # -- decode ----------------------------------------------------------------------------------------
    async def pick_decode(
        self, layer_tokens: list[int], max_new_tokens: int, wait_s: float = 0.0, max_waiting: int = 0
    ) -> DecodeSlot:
        """A decode worker that can admit a cache of ``layer_tokens`` now (see the strategies above).

        Room is the worker's last reported admissible blocks less those already promised to requests
        picked for it whose caches are still on their way (``DecodeSlot.release`` when they arrive).

        When none can, the request waits in a first-come-first-served queue of at most ``max_waiting``
        requests for up to ``wait_s`` (the head looks again every ``ADMIT_POLL_S``); then
        RESOURCE_EXHAUSTED. A request larger than every worker's whole pool is refused at once.
        """
        self._watch_pending()
        if not self._admit_queue:
            slot = await self._try_decode(layer_tokens, max_new_tokens)
            if slot is not None:
                return slot
        if len(self._admit_queue) >= max_waiting or wait_s <= 0:
            raise ResourceExhausted(
                f"no decode worker has room for this request ({len(self._admit_queue)} requests waiting)"
            )
        ticket = object()
        self._admit_queue.append(ticket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        try:
            while True:
                if self._admit_queue[0] is ticket:
                    slot = await self._try_decode(layer_tokens, max_new_tokens)
                    if slot is not None:
                        return slot
                if loop.time() >= deadline:
                    raise ResourceExhausted(f"no decode worker had room for this request within {wait_s:g} s")
                await asyncio.sleep(ADMIT_POLL_S)
        finally:
            self._admit_queue.remove(ticket)

    async def _try_decode(self, layer_tokens: list[int], max_new_tokens: int) -> DecodeSlot | None:
        if not self.decode:
            raise Unavailable("no decode worker is registered")
        if self.strategy == "poll":
            return await self._poll_decode(layer_tokens, max_new_tokens)
        pool = self.decode
        if not pool.live:  # none reported lately (a gateway just started, a worker back from a pause): ask
            await asyncio.gather(*(self._poll(w) for w in list(pool.values())[: self.sample_k]))
        largest = self._largest
        if largest is not None and largest.total_blocks < _blocks_needed(
            largest, layer_tokens, max_new_tokens, whole=True
        ):
            raise ResourceExhausted(
                f"this request (max_new_tokens={max_new_tokens}) needs more KV blocks than a decode worker holds"
            )
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.strategy == "kv":
            for _ in range(SAMPLE_ROUNDS):
                best, best_room, need = None, 0, 0
                drawn = pool.draw(self.rng, self.sample_k)
                if any(w.polled for w in drawn):  # workers without a load stream: their load now
                    await asyncio.gather(*(self._poll(w) for w in drawn if w.polled))
                    now = loop.time()
                for w in drawn:
                    if w.draining or w.load.draining or w.refused or not self._fresh(pool, w, now):
                        continue
                    n = _blocks_needed(w.load, layer_tokens, max_new_tokens)
                    room = w.load.admit_blocks - w.pending_blocks
                    if n <= room and (best is None or (room, -w.in_flight) > (best_room, -best.in_flight)):
                        best, best_room, need = w, room, n
                if best is not None:
                    best.pending_blocks += need
                    return DecodeSlot(best, need)
                if len(pool.live) <= self.sample_k:
                    break  # every worker was looked at
        else:
            w = self._draw_unchecked(pool, now)
            if w is not None:
                need = _blocks_needed(w.load, layer_tokens, max_new_tokens)
                w.pending_blocks += need
                return DecodeSlot(w, need)
        if not pool.live:
            raise Unavailable("no decode worker is reachable")
        return None

    def _draw_unchecked(self, pool: _Pool, now: float) -> Worker | None:
        """random, round_robin, best2: a serving worker with a fresh report, room or not."""
        for _ in range(SAMPLE_ROUNDS * self.sample_k):
            if not pool.live:
                return None
            if self.strategy == "round_robin":
                pool.next = (pool.next + 1) % len(pool.live)
                drawn = [pool.live[pool.next]]
            else:
                drawn = pool.draw(self.rng, 2 if self.strategy == "best2" else 1)
            ok = [w for w in drawn if not (w.draining or w.load.draining) and self._fresh(pool, w, now)]
            if ok:
                return max(ok, key=lambda w: w.load.free_blocks - w.pending_blocks)
        return None

    async def _poll_decode(self, layer_tokens: list[int], max_new_tokens: int) -> DecodeSlot | None:
        """``poll``: every decode worker's ``GetLoad`` now, then the most room (the router before push)."""
        workers = list(self.decode.values())
        loads = await asyncio.gather(*(self._poll(w) for w in workers))
        live = [
            (w, ld)
            for w, ld in zip(workers, loads, strict=True)
            if ld is not None and not ld.draining and not w.draining
        ]
        if not live:
            raise Unavailable("no decode worker is reachable")
        most = max(
            ld.total_blocks - _blocks_needed(ld, layer_tokens, max_new_tokens, whole=True) for _, ld in live
        )
        if most < 0:
            raise ResourceExhausted(
                f"this request (max_new_tokens={max_new_tokens}) needs more KV blocks than a decode worker holds"
            )
        room = {w.address: ld.admit_blocks - w.pending_blocks for w, ld in live}
        fitting = [
            (w, ld) for w, ld in live if _blocks_needed(ld, layer_tokens, max_new_tokens) <= room[w.address]
        ]
        if not fitting:
            return None
        w, ld = max(fitting, key=lambda p: (room[p[0].address], -p[0].in_flight))
        need = _blocks_needed(ld, layer_tokens, max_new_tokens)
        w.pending_blocks += need  # no await since the room was read: the promise is atomic on this loop
        return DecodeSlot(w, need)


def _blocks_needed(
    load: worker_pb2.WorkerLoad, layer_tokens: list[int], max_new_tokens: int, whole: bool = False
) -> int:
    """Blocks the worker takes at admission (the cache, plus max_new_tokens if it reserves them), or
    with ``whole`` the most the sequence can ever hold."""
    extra = max_new_tokens if load.reserves_new_tokens or whole else 0
    return blocks_needed(layer_tokens, extra, max(load.block_size, 1))
