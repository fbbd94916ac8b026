"""Simulated prefill and decode workers, reached through stubs shaped like the generated gRPC ones
(``Prefill``, ``GetLoad``, ``WatchLoad``), so the real ``Router`` talks to them as it talks to servers.

Their service times come from a ``Profile``, spent on the machine's CPU (``cpu.py``: a device per worker,
or one CPU they all share). A prefill worker runs one prefill at a time (as the real one: one compute
thread), first come first served, then hands the cache to its decode worker (the hand-off overlaps the
next prefill); an image-cache hit saves part of the vision tokens' time. A decode worker
admits a cache (at its header) if its pool has the blocks (admission "reserve": the cache and its max_new_tokens), else
refuses it (``PoolFull``, the worker's ``REFUSAL_POOL_FULL``); it steps its batch (up to ``max_batch``
sequences) one token per step, each step taking the profile's time for that batch. Both push their load
on change (within ``CHECK_EVERY_S``) and at least every ``REPORT_EVERY_S``, as ``common/load_stream.py``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from vlkv.common.block_math import blocks_needed
from vlkv.common.load_stream import CHECK_EVERY_S, REPORT_EVERY_S
from vlkv.common.reuse import ANONYMOUS
from vlkv.v1 import worker_pb2

from vlkv_lab.sim.cpu import Dedicated, SharedCPU
from vlkv_lab.sim.profile import Profile

IMAGE_CACHE_ENTRIES = 256  # images a simulated prefill worker keeps


class PoolFull(Exception):
    """The decode worker has no room for the cache (re-queue at the gateway)."""


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_tokens: int
    vision_tokens: int
    max_new_tokens: int
    images: tuple[str, ...] = ()
    tenant: str = ANONYMOUS
    layer_tokens: list[int] = field(default_factory=list)
    # outcome
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    status: str = ""
    refusals: int = 0
    queued: bool = False


@dataclass(eq=False)
class _Seq:
    req: SimRequest
    blocks: int
    left: int  # tokens still to generate
    done: asyncio.Future


class _Reporter:
    """Pushes ``snapshot()`` on change (``changed``) within CHECK_EVERY_S, and every REPORT_EVERY_S."""

    def __init__(self) -> None:
        self.version = 0
        self.stopped = False
        self._wake: list[asyncio.Future] = []

    def changed(self) -> None:
        self.version += 1
        for f in self._wake:
            if not f.done():
                f.set_result(None)
        self._wake.clear()

    async def stream(self, snapshot, extra=None):
        loop = asyncio.get_running_loop()
        while not self.stopped:
            load = snapshot()
            if extra is not None:
                extra(load)
            seen = self.version
            yield load
            await asyncio.sleep(CHECK_EVERY_S)  # reports are at least this far apart
            if self.version == seen:  # wait for a change, or the heartbeat
                f = loop.create_future()
                self._wake.append(f)
                timer = loop.call_later(REPORT_EVERY_S - CHECK_EVERY_S, _resolve, f)
                await f
                timer.cancel()


def _resolve(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


class SimDecode:
    def __init__(self, address: str, prof: Profile, cpu: Dedicated | SharedCPU | None = None) -> None:
        self.address = address
        self.prof = prof
        self.cpu = cpu if isinstance(cpu, SharedCPU) else None  # None: steps take their profiled time
        self.free = prof.pool_blocks
        self.admitted: deque[_Seq] = deque()  # waiting for a batch slot
        self.batch: set[_Seq] = set()
        self.step_no = 0
        self.ends: dict[int, list[_Seq]] = {}  # step number -> sequences whose last token it makes
        self.kv_bytes = 0
        self.draining = False
        self.report = _Reporter()
        self.stepping = False
        self.tokens = 0
        self.itl: dict[int, int] = {}  # step time (0.1 ms) -> tokens emitted after it
        self.busy_s = 0.0

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            address=self.address,
            running=len(self.batch),
            waiting=len(self.admitted),
            free_blocks=self.free,
            total_blocks=self.prof.pool_blocks,
            block_size=self.prof.block_size,
            draining=self.draining,
            admit_blocks=self.free,
            reserves_new_tokens=True,
        )

    def reserve(self, req: SimRequest) -> _Seq:
        """Admit the cache of ``req`` at its header: its blocks (and max_new_tokens), or ``PoolFull``."""
        need = blocks_needed(req.layer_tokens, req.max_new_tokens, self.prof.block_size)
        if need > self.free or self.draining:
            raise PoolFull(f"KV pool full: request needs {need} blocks, {self.free} available")
        self.free -= need
        self.report.changed()
        return _Seq(req, need, req.max_new_tokens - 1, asyncio.get_running_loop().create_future())

    def start(self, seq: _Seq) -> asyncio.Future:
        """The whole cache arrived: the first token goes out now; the future ends with the last token."""
        seq.req.tokens = 1
        self.kv_bytes += self.prof.kv_bytes(seq.req.prompt_tokens)
        if seq.left <= 0:
            self._finish(seq)
        else:
            self.admitted.append(seq)
            if not self.stepping:
                self._start_step()
        self.report.changed()
        return seq.done

    def _start_step(self) -> None:
        while self.admitted and len(self.batch) < self.prof.max_batch:
            seq = self.admitted.popleft()
            self.batch.add(seq)
            self.ends.setdefault(self.step_no + seq.left, []).append(seq)
        if not self.batch:
            self.stepping = False
            return
        self.stepping = True
        dt = self.prof.step(len(self.batch), self.kv_bytes / 1e6)
        self.busy_s += dt
        if self.cpu is None:
            asyncio.get_running_loop().call_later(dt, self._end_step, dt)
        else:
            asyncio.get_running_loop().create_task(self._shared_step(dt))

    async def _shared_step(self, dt: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.cpu.run(dt)
        self._end_step(loop.time() - start)

    def _end_step(self, dt: float) -> None:
        n = len(self.batch)
        self.tokens += n
        key = round(dt * 1e4)
        self.itl[key] = self.itl.get(key, 0) + n
        self.step_no += 1
        finished = self.ends.pop(self.step_no, ())
        for seq in finished:
            self.batch.discard(seq)
            seq.req.tokens = seq.req.max_new_tokens
            self._finish(seq)
        if finished:
            self.report.changed()
        self._start_step()

    def _finish(self, seq: _Seq) -> None:
        self.free += seq.blocks
        self.kv_bytes -= self.prof.kv_bytes(seq.req.prompt_tokens)
        if not seq.done.done():
            seq.done.set_result(None)

    @property
    def idle(self) -> bool:
        return not self.batch and not self.admitted


class SimPrefill:
    def __init__(
        self, address: str, prof: Profile, decoders: dict[str, SimDecode], cpu: Dedicated | SharedCPU
    ) -> None:
        self.address = address
        self.prof = prof
        self.decoders = decoders
        self.cpu = cpu
        self.queue = 0  # prefills waiting or running
        self.running = 0
        self.thread = asyncio.Lock()  # its one compute thread, first come first served
        self.images: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.image_log: list[tuple[bool, tuple[str, str]]] = []  # (added, key), for each watcher to catch up
        self.hits = 0
        self.draining = False
        self.report = _Reporter()

    def load(self) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(
            address=self.address,
            running=self.running,
            waiting=max(0, self.queue - self.running),
            draining=self.draining,
            image_cache=worker_pb2.ImageCacheStats(entries=len(self.images), hits=self.hits),
        )

    def digests(self):
        """For one watcher: adds the image-cache entries added and evicted since its previous report."""
        pos = 0

        def extra(load: worker_pb2.WorkerLoad) -> None:
            nonlocal pos
            for added, (tenant, image) in self.image_log[pos:]:
                d = load.images_added.add() if added else load.images_evicted.add()
                d.tenant, d.image_hash = tenant, image
            pos = len(self.image_log)

        return extra

    async def prefill(self, req: SimRequest, decode_address: str):
        self.queue += 1
        self.report.changed()
        try:
            hit_tokens = 0
            per_image = req.vision_tokens // max(len(req.images), 1)
            for image in req.images:
                key = (req.tenant, image)
                if key in self.images:
                    self.images.move_to_end(key)
                    hit_tokens += per_image
                    self.hits += 1
            async with self.thread:
                self.running += 1
                try:
                    await self.cpu.run(self.prof.prefill_s(req.prompt_tokens, req.vision_tokens, hit_tokens))
                finally:
                    self.running -= 1
            for image in req.images:
                key = (req.tenant, image)
                if key not in self.images:
                    self.images[key] = None
                    self.image_log.append((True, key))
                    if len(self.images) > IMAGE_CACHE_ENTRIES:
                        old, _ = self.images.popitem(last=False)
                        self.image_log.append((False, old))
        finally:
            self.queue -= 1
            self.report.changed()
        # the hand-off: the decode worker admits at the header (or refuses), the bytes follow
        decoder = self.decoders[decode_address]
        seq = decoder.reserve(req)
        await self.cpu.run(self.prof.handoff_s(self.prof.kv_bytes(req.prompt_tokens)))
        return decoder.start(seq)


class _Stub:
    def __init__(self, worker, prof: Profile) -> None:
        self.worker = worker
        self.prof = prof

    async def GetLoad(self, request, timeout=None):
        await asyncio.sleep(self.prof.rpc_s)
        return self.worker.load()

    def WatchLoad(self, request):
        extra = self.worker.digests() if isinstance(self.worker, SimPrefill) else None
        return self.worker.report.stream(self.worker.load, extra)


def sim_connect(workers: dict[str, object], prof: Profile):
    """A ``Router.connect`` that reaches simulated workers by address (no channel)."""

    def connect(router, address: str, kind: str):
        return None, _Stub(workers[address], prof)

    return connect
