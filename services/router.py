"""Chooses workers for a request: least-loaded prefill worker, decode worker with room in its KV pool.

The gateway counts its own in-flight prefills per worker (no extra round trip); for decode it asks each
worker's ``GetLoad`` and picks the one with the most free blocks among those that are not draining and
whose free blocks cover the request's estimated need. Workers that do not answer are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

import grpc
from vlkv.common.errors import ResourceExhausted, Unavailable
from vlkv.common.grpc_server import make_channel
from vlkv.common.security import SecurityConfig
from vlkv.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 2.0


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0  # requests the gateway has on this worker now
    draining: bool = False  # takes no new requests; removed once in_flight reaches 0
    reachable: bool = True
    load: worker_pb2.WorkerLoad = field(default_factory=worker_pb2.WorkerLoad)


class Router:
    def __init__(self, max_message_bytes: int, security=None) -> None:
        self._max_message_bytes = max_message_bytes
        self._security = security if security is not None else SecurityConfig()
        self.prefill: dict[str, Worker] = {}
        self.decode: dict[str, Worker] = {}

    def _add(self, pool: dict[str, Worker], address: str, stub_cls) -> None:
        if address not in pool:
            ch = make_channel(address, self._security, self._max_message_bytes)
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

    def pick_prefill(self, exclude: set[str] = frozenset()) -> Worker:
        """The serving prefill worker with the fewest requests in flight from this gateway."""
        live = [w for w in self.prefill.values() if not w.draining and w.address not in exclude]
        if not live:
            raise Unavailable("no prefill worker is available")
        return min(live, key=lambda w: (not w.reachable, w.in_flight))

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

    async def pick_decode(self, layer_tokens: list[int], max_new_tokens: int) -> Worker:
        """The decode worker with the most free blocks that can hold ``layer_tokens`` + max_new_tokens."""
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
        fitting = [
            (w, ld)
            for w, ld in live
            if sum(math.ceil((n + max_new_tokens) / max(ld.block_size, 1)) for n in layer_tokens)
            <= ld.free_blocks
        ]
        if not fitting:
            best = max(ld.free_blocks for _, ld in live)
            raise ResourceExhausted(f"no decode worker has room for this request (most free blocks: {best})")
        return max(fitting, key=lambda p: (p[1].free_blocks, -p[0].in_flight))[0]
