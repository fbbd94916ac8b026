"""``vlkv simulate``'s cluster: the real ``Router`` (one per gateway), its admission queue and the real
``Autoscaler``, unchanged, over simulated workers (``workers.py``), in virtual time (``vclock.py``).

Each request goes the gateway's way (``services/gateway.py``): its validation (the profile's ``prep_s``,
on at most ``prep_threads`` requests at once), ``Router.pick_decode`` (waiting in the
admission queue when no worker has room), ``Router.pick_prefill``, the prefill, the hand-off to the picked
decode worker (a ``PoolFull`` refusal re-queues until the request's admission wait is spent; then the
request is lost), then its tokens. The router's CPU time is measured (thread CPU time of every step of every router
coroutine: picks, the admission queue, the load streams' reports) and, by default, charged to the
gateway's event loop: a gateway busy with router work delays its requests by that much.
"""

from __future__ import annotations

import asyncio
import collections.abc
import gc
import math
import time
from dataclasses import dataclass, field

from vlkv.common.block_math import blocks_needed
from vlkv.common.errors import VlkvError
from vlkv.deploy.autoscaler import Autoscaler, PoolSpec, Replica
from vlkv.services import load_watch
from vlkv.services import router as router_module
from vlkv.services.router import Router

from vlkv_lab.sim.cpu import machine_cpu
from vlkv_lab.sim.profile import Profile
from vlkv_lab.sim.trace import Mix
from vlkv_lab.sim.workers import PoolFull, SimDecode, SimPrefill, SimRequest, sim_connect

_ROUTER_FILES = {router_module.__file__, load_watch.__file__}  # coroutines timed as router work
SAMPLE_S = 1.0  # the cluster's state is sampled this often (virtual seconds)


@dataclass
class SimConfig:
    decode: int = 10
    prefill: int = 4
    strategy: str = "kv"
    sample_k: int = router_module.SAMPLE_K
    gateways: int = 1
    admit_wait_s: float = 60.0
    max_waiting: int = 1_000_000
    charge_router_cpu: bool = True
    warmup_s: float = 0.0  # requests arriving before this are not counted in the latencies
    seed: int = 0
    # autoscaling (off: the pools stay at decode/prefill)
    autoscale: bool = False
    decode_max: int = 0
    prefill_max: int = 0
    decode_target: float = 0.8  # pool occupancy share
    prefill_target: float = 2.0  # prefills in flight and queued per replica
    interval_s: float = 1.0
    downscale_delay_s: float = 30.0
    min_uptime_s: float = 120.0
    label: str = ""
    background: list = field(
        default_factory=list
    )  # (seconds from the trace's start, threads): the box's other load


def capacity(prof: Profile, mix: Mix, decode: int) -> tuple[float, int]:
    """Requests per second ``decode`` workers sustain with the mix's mean request, and the prefill workers
    that keep up with them (the pools in proportion)."""
    vision = prof.vision_tokens_per_image * mix.images * mix.image_share
    prompt = mix.prompt_tokens + vision
    need = blocks_needed(prof.layer_tokens(int(prompt)), mix.new_tokens, prof.block_size)
    conc = max(1, min(prof.max_batch, prof.pool_blocks // max(need, 1)))
    per_decode = conc / (mix.new_tokens * prof.step(conc))
    hits = mix.image_reuse * vision
    per_prefill = 1 / prof.prefill_s(int(prompt), int(vision), int(hits * 0.5))
    rate = decode * per_decode
    return rate, max(1, math.ceil(rate / per_prefill))


class _Gateway:
    def __init__(self, router: Router, charge: bool, prep_threads: int = 4) -> None:
        self.router = router
        self.prepare = asyncio.Semaphore(max(prep_threads, 1))  # the validation pool
        self.charge = charge
        self.cpu_ns = 0  # all router work
        self.pick_ns = 0  # of which picks (pick_decode with its admission queue, pick_prefill, note_images)
        self.busy_until = 0.0

    def add(self, ns: int, now: float, pick: bool = False) -> None:
        self.cpu_ns += ns
        if pick:
            self.pick_ns += ns
        if self.charge:
            self.busy_until = max(self.busy_until, now) + ns / 1e9

    async def wait_cpu(self) -> None:
        delay = self.busy_until - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)


class _Timed(collections.abc.Coroutine):
    """Runs ``coro``, adding the thread CPU time of each of its steps to a gateway."""

    __slots__ = ("coro", "gw", "loop", "pick")

    def __init__(self, coro, gw: _Gateway, loop, pick: bool = False) -> None:
        self.coro, self.gw, self.loop, self.pick = coro, gw, loop, pick

    def send(self, value):
        t = time.thread_time_ns()
        try:
            return self.coro.send(value)
        finally:
            self.gw.add(time.thread_time_ns() - t, self.loop.time(), self.pick)

    def throw(self, *args):
        t = time.thread_time_ns()
        try:
            return self.coro.throw(*args)
        finally:
            self.gw.add(time.thread_time_ns() - t, self.loop.time(), self.pick)

    def close(self):
        return self.coro.close()

    def __await__(self):
        return self

    def __next__(self):
        return self.send(None)

    def __iter__(self):
        return self


@dataclass
class Sample:
    t: float
    rate: float  # arrivals per second over the last sample period
    queued: int
    occupancy: float  # decode pool blocks in use, share of all
    decode: int  # decode workers serving
    prefill: int
    tokens_s: float


@dataclass
class SimResult:
    cfg: SimConfig
    requests: list[SimRequest]
    samples: list[Sample] = field(default_factory=list)
    events: list = field(default_factory=list)  # the autoscaler's
    itl: dict[int, int] = field(default_factory=dict)
    router_cpu_ns: int = 0
    pick_cpu_ns: int = 0
    wall_s: float = 0.0
    sim_s: float = 0.0
    tokens: int = 0
    workers_seen: int = 0


class _SimReplicas:
    """The autoscaler's replica operations on simulated workers."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    async def alive(self, r: Replica) -> bool:
        return True

    def drain(self, r: Replica) -> None:
        r.actor.draining = True
        r.actor.report.changed()
        for gw in self.sim.gateways[1:]:
            gw.router.set_draining(r.address)

    async def stop(self, r: Replica) -> None:
        r.actor.report.stopped = True
        for gw in self.sim.gateways[1:]:
            await gw.router.remove(r.address)

    def kill(self, r: Replica) -> None:
        r.actor.report.stopped = True


class Simulation:
    def __init__(self, cfg: SimConfig, prof: Profile, requests: list[SimRequest], progress=None) -> None:
        self.cfg = cfg
        self.prof = prof
        self.requests = requests
        self.progress = progress
        self.workers: dict[str, object] = {}
        self.decoders: dict[str, SimDecode] = {}
        self.gateways: list[_Gateway] = []
        self._count = {"prefill": 0, "decode": 0}
        self.autoscaler: Autoscaler | None = None
        self.cpu = machine_cpu(prof.shared_cores, prof.background_threads)

    def _new_worker(self, kind: str):
        self._count[kind] += 1
        address = f"sim-{kind}-{self._count[kind]}"
        if kind == "decode":
            w = self.decoders[address] = SimDecode(address, self.prof, self.cpu)
        else:
            w = SimPrefill(address, self.prof, self.decoders, self.cpu)
        self.workers[address] = w
        return w

    async def _start_actor(self, kind: str) -> Replica:
        """The autoscaler's new replica: serving after the profile's start-up time."""
        await asyncio.sleep(self.prof.worker_start_s)
        w = self._new_worker(kind)
        for gw in self.gateways[1:]:
            (gw.router.add_prefill if kind == "prefill" else gw.router.add_decode)(w.address)
        return Replica(kind, w, w.address, state="serving")

    def _task_factory(self, loop, coro, **kwargs):
        frame = getattr(coro, "cr_frame", None)
        if frame is not None and coro.cr_code.co_filename in _ROUTER_FILES:
            gw = self._by_router.get(id(frame.f_locals.get("self")))
            if gw is not None:
                coro = _Timed(coro, gw, loop)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def run(self) -> SimResult:
        loop = asyncio.get_running_loop()
        wall = time.perf_counter()
        gc.disable()  # collected once per sampled second instead, outside any router step (sampler)
        try:
            return await self._run(loop, wall)
        finally:
            gc.enable()

    async def _run(self, loop, wall: float) -> SimResult:
        cfg, prof = self.cfg, self.prof
        connect = sim_connect(self.workers, prof)
        initial = [self._new_worker("decode") for _ in range(cfg.decode)]
        initial += [self._new_worker("prefill") for _ in range(cfg.prefill)]
        for g in range(cfg.gateways):
            router = Router(
                strategy=cfg.strategy, sample_k=cfg.sample_k, seed=cfg.seed * 1000 + g, connect=connect
            )
            self.gateways.append(_Gateway(router, cfg.charge_router_cpu, prof.prep_threads))
        self._by_router = {id(gw.router): gw for gw in self.gateways}
        self._by_router.update((id(gw.router.watch), gw) for gw in self.gateways)  # its load streams
        loop.set_task_factory(self._task_factory)
        for gw in self.gateways:
            for w in initial:
                (gw.router.add_decode if isinstance(w, SimDecode) else gw.router.add_prefill)(w.address)
        if cfg.autoscale:
            specs = {
                "prefill": PoolSpec(cfg.prefill, max(cfg.prefill_max, cfg.prefill), cfg.prefill_target),
                "decode": PoolSpec(cfg.decode, max(cfg.decode_max, cfg.decode), cfg.decode_target),
            }
            self.autoscaler = Autoscaler(
                self.gateways[0].router, self._start_actor, specs, cfg.interval_s, cfg.downscale_delay_s,
                cfg.min_uptime_s, replicas_api=_SimReplicas(self),
            )  # fmt: skip
            for w in initial:
                kind = "decode" if isinstance(w, SimDecode) else "prefill"
                self.autoscaler.replicas.append(Replica(kind, w, w.address, state="serving"))
            self.autoscaler.start()
        await asyncio.sleep(2 * load_watch.POLL_S)  # the first load reports arrive
        t0 = loop.time()
        for r in self.requests:
            r.arrival += t0
            r.layer_tokens = prof.layer_tokens(r.prompt_tokens)
        result = SimResult(cfg, self.requests)
        sampler = loop.create_task(self._sample(result, t0))
        if cfg.background and hasattr(self.cpu, "set_background"):
            loop.create_task(self._replay_background(t0))
        tasks = []
        for r in self.requests:
            delay = r.arrival - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(self._serve(r, self.gateways[r.index % len(self.gateways)])))
        await asyncio.gather(*tasks)
        end = loop.time()
        sampler.cancel()
        if self.autoscaler is not None:
            await self.autoscaler.stop()
            result.events = list(self.autoscaler.events)
        for gw in self.gateways:
            await gw.router.close()
        for w in self.workers.values():
            w.report.stopped = True
        for r in self.requests:
            r.arrival -= t0
            if r.end is not None:
                r.end -= t0
        for e in result.events:
            e.at -= t0
        result.router_cpu_ns = sum(gw.cpu_ns for gw in self.gateways)
        result.pick_cpu_ns = sum(gw.pick_ns for gw in self.gateways)
        for d in self.decoders.values():
            result.tokens += d.tokens
            for k, n in d.itl.items():
                result.itl[k] = result.itl.get(k, 0) + n
        result.tokens += sum(r.tokens > 0 for r in self.requests)  # each first token (from the prefill)
        result.workers_seen = len(self.workers)
        result.sim_s = end - t0
        result.wall_s = time.perf_counter() - wall
        return result

    async def _serve(self, req: SimRequest, gw: _Gateway) -> None:
        loop = asyncio.get_running_loop()
        router = gw.router
        start = loop.time()
        prep = self.prof.prep_s(req.vision_tokens)
        if prep:  # the gateway validates the request before routing it
            async with gw.prepare:
                await self.cpu.run(prep)
        give_up = loop.time() + self.cfg.admit_wait_s
        while loop.time() < give_up or not req.refusals:
            queued = router.num_queued
            wait_s = max(give_up - loop.time(), 0.0)
            try:
                slot = await _Timed(
                    router.pick_decode(req.layer_tokens, req.max_new_tokens, wait_s, self.cfg.max_waiting),
                    gw,
                    loop,
                )
            except VlkvError as exc:
                req.status = exc.code.name
                return
            req.queued = req.queued or queued > 0 or loop.time() > start + 1e-3
            await gw.wait_cpu()
            decode = slot.worker
            decode.in_flight += 1
            try:
                t = time.thread_time_ns()
                prefill = router.pick_prefill(images=req.images, tenant=req.tenant)
                gw.add(time.thread_time_ns() - t, loop.time(), True)
                prefill.in_flight += 1
                try:
                    done = await self.workers[prefill.address].prefill(req, decode.address)
                except PoolFull:
                    req.refusals += 1
                    router.note_refusal(decode)
                    continue
                finally:
                    prefill.in_flight -= 1
                    slot.settle()
                t = time.thread_time_ns()
                router.note_images(prefill.address, req.images, req.tenant)
                gw.add(time.thread_time_ns() - t, loop.time(), True)
                req.ttft = loop.time() - start
                if self.prof.overhead_s and self.prof.shared_cores:  # its CPU off the critical path
                    loop.create_task(self.cpu.run(self.prof.overhead_s))
                await done
                req.end = loop.time()
                req.status = "OK"
                return
            finally:
                decode.in_flight -= 1
        req.status = "RESOURCE_EXHAUSTED"  # refused at every hand-off: lost

    async def _replay_background(self, t0: float) -> None:
        loop = asyncio.get_running_loop()
        for t, threads in self.cfg.background:
            if t0 + t > loop.time():
                await asyncio.sleep(t0 + t - loop.time())
            self.cpu.set_background(threads)

    async def _sample(self, result: SimResult, t0: float) -> None:
        loop = asyncio.get_running_loop()
        arrivals = sorted(r.arrival for r in self.requests)
        i, last_tokens = 0, 0
        total = arrivals[-1] - t0 if arrivals else 0.0
        while True:
            await asyncio.sleep(SAMPLE_S)
            gc.collect(1)
            now = loop.time()
            n = 0
            while i < len(arrivals) and arrivals[i] <= now:
                i, n = i + 1, n + 1
            serving = [d for d in self.decoders.values() if not d.draining and not d.report.stopped]
            used = sum(self.prof.pool_blocks - d.free for d in serving)
            tokens = sum(d.tokens for d in self.decoders.values())
            prefill = sum(
                1
                for w in self.workers.values()
                if isinstance(w, SimPrefill) and not w.draining and not w.report.stopped
            )
            result.samples.append(
                Sample(
                    now - t0,
                    n / SAMPLE_S,
                    sum(gw.router.num_queued for gw in self.gateways),
                    used / max(1, len(serving) * self.prof.pool_blocks),
                    len(serving),
                    prefill,
                    (tokens - last_tokens) / SAMPLE_S,
                )
            )
            last_tokens = tokens
            if self.progress is not None:
                self.progress.set_postfix(
                    f"t={now - t0:.0f}/{total:.0f}s queued={result.samples[-1].queued} decode={len(serving)}"
                )
                self.progress.update(1)
