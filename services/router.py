"""Chooses workers for a request: a prefill worker (one holding the request's images in its image cache, unless
it is much busier than the least-loaded one), a decode worker with room in its KV pool.

The gateway counts its own in-flight prefills per worker (no extra round trip); for decode it asks each
worker's ``GetLoad`` and picks the one with the most free blocks among those that are not draining and
whose free blocks cover the request's estimated need. Workers that do not answer are skipped.

Cache-aware prefill routing: the gateway remembers (bounded, least recently used first out) which prefill
worker last prefilled each (tenant, image hash); a request goes to the worker holding most of its images
unless that worker has more than ``BUSY_MARGIN`` requests in flight beyond the least-loaded worker (then
the least-loaded one prefills it and becomes the holder). A worker may have evicted the image since: that
costs a miss there, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import grpc
from vlkv.common.errors import ResourceExhausted, Unavailable
from vlkv.common.grpc_server import make_channel
from vlkv.common.security import SecurityConfig
from vlkv.decode_worker.block_manager import blocks_needed
from vlkv.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 2.0
ADMIT_POLL_S = 0.02  # how often the head of the admission queue asks the decode workers for room
BUSY_MARGIN = 2  # a holder of the images is "much busier" with more than this many extra requests in flight
MAX_IMAGE_HOLDERS = 65536  # (tenant, image hash) -> prefill worker entries the gateway remembers


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0  # requests the gateway has on this worker now
    draining: bool = False  # takes no new requests; removed once in_flight reaches 0
    reachable: bool = True
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)
    pending_blocks: int = 0  # decode: blocks promised to requests whose cache has not arrived yet


@dataclass
class DecodeSlot:
    """A decode worker picked for a request, with the blocks promised to it until its cache arrives."""

    worker: Worker
    blocks: int

    def release(self) -> None:
        """The cache arrived (the worker's own load counts it now) or never will; idempotent."""
        self.worker.pending_blocks -= self.blocks
        self.blocks = 0


class Router:
    def __init__(self, max_message_bytes: int, security=None, keepalive_s: float = 0.0) -> None:
        self._max_message_bytes = max_message_bytes
        self._keepalive_s = keepalive_s  # pings on every worker channel (grpc_server.keepalive_options)
        self._security = security if security is not None else SecurityConfig()
        self.prefill: dict[str, Worker] = {}
        self.decode: dict[str, Worker] = {}
        self._admit_queue: deque[object] = deque()  # requests waiting for a decode worker with room
        self._holders: OrderedDict[tuple[str, str], str] = OrderedDict()  # (tenant, image) -> address

    @property
    def num_queued(self) -> int:
        """Requests waiting for a decode worker with room."""
        return len(self._admit_queue)

    def _add(self, pool: dict[str, Worker], address: str, stub_cls) -> None:
        if address not in pool:
            ch = make_channel(address, self._security, self._max_message_bytes, self._keepalive_s)
            pool[address] = Worker(address, ch, stub_cls(ch))

    def add_prefill(self, address: str) -> None:
        self._add(self.prefill, address, worker_pb2_grpc.PrefillWorkerStub)

    def add_decode(self, address: str) -> None:
        self._add(self.decode, address, worker_pb2_grpc.DecodeWorkerStub)

    async def remove(self, address: str) -> None:
        for pool in (self.prefill, self.decode):
            w = pool.pop(address, None)
            if w is not None:
                await w.channel.close()

    async def close(self) -> None:
        for address in list(self.prefill) + list(self.decode):
            await self.remove(address)

    def set_draining(self, address: str) -> None:
        for pool in (self.prefill, self.decode):
            if address in pool:
                pool[address].draining = True

    def pick_prefill(
        self, exclude: set[str] = frozenset(), images: tuple[str, ...] = (), tenant: str = ""
    ) -> Worker:
        """The serving prefill worker that holds most of ``images`` (of ``tenant``) if it is not much busier
        than the least-loaded one (``BUSY_MARGIN``), else the one with the fewest requests in flight."""
        live = [w for w in self.prefill.values() if not w.draining and w.address not in exclude]
        if not live:
            raise Unavailable("no prefill worker is available")
        least = min(live, key=lambda w: (not w.reachable, w.in_flight))
        held: dict[str, int] = {}
        for image in images:
            address = self._holders.get((tenant, image))
            if address is not None:
                held[address] = held.get(address, 0) + 1
        holders = [w for w in live if w.reachable and held.get(w.address)]
        if holders:
            best = max(holders, key=lambda w: (held[w.address], -w.in_flight))
            if best.in_flight - least.in_flight <= BUSY_MARGIN:
                return best
        return least

    def note_images(self, address: str, images: tuple[str, ...], tenant: str = "") -> None:
        """``address`` prefilled these images (it holds them in its image cache now)."""
        for image in images:
            key = (tenant, image)
            self._holders[key] = address
            self._holders.move_to_end(key)
        while len(self._holders) > MAX_IMAGE_HOLDERS:
            self._holders.popitem(last=False)

    async def _poll(self, w: Worker) -> worker_pb2.WorkerLoad | None:
        try:
            w.load = await w.stub.GetLoad(worker_pb2.LoadRequest(), timeout=LOAD_TIMEOUT_S)
            w.reachable = True
            return w.load
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s did not answer GetLoad: %s", w.address, exc.code().name)
            w.reachable = False
            return None

    async def poll_all(self) -> None:
        """Refresh every worker's load (used by the autoscaler and `vlkv status`)."""
        workers = list(self.prefill.values()) + list(self.decode.values())
        await asyncio.gather(*(self._poll(w) for w in workers))

    async def pick_decode(
        self, layer_tokens: list[int], max_new_tokens: int, wait_s: float = 0.0, max_waiting: int = 0
    ) -> DecodeSlot:
        """The decode worker with the most room that can admit a cache of ``layer_tokens`` now.

        Room is the worker's last reported admissible blocks less those already promised to requests
        picked for it whose caches are still on their way (``DecodeSlot.release`` when they arrive).

        When none can, the request waits in a first-come-first-served queue of at most ``max_waiting``
        requests for up to ``wait_s`` (the head polls the workers' load); then RESOURCE_EXHAUSTED. A
        request larger than every worker's whole pool is refused at once.
        """
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
        deadline = time.monotonic() + wait_s
        try:
            while True:
                if self._admit_queue[0] is ticket:
                    slot = await self._try_decode(layer_tokens, max_new_tokens)
                    if slot is not None:
                        return slot
                if time.monotonic() >= deadline:
                    raise ResourceExhausted(f"no decode worker had room for this request within {wait_s:g} s")
                await asyncio.sleep(ADMIT_POLL_S)
        finally:
            self._admit_queue.remove(ticket)

    async def _try_decode(self, layer_tokens: list[int], max_new_tokens: int) -> DecodeSlot | None:
        if not self.decode:
            raise Unavailable("no decode worker is registered")
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
