"""Replica counts for the prefill and decode pools, decided from live load; Ray does the placing.

Every ``interval_s`` the autoscaler reads each worker's last pushed load (the router keeps it, ``WatchLoad``) and:
- replaces workers whose actor died (they leave the router at once, so no new request goes there);
- prefill: wants ``ceil(ongoing_and_queued / target_ongoing)`` replicas (TTFT pressure), where ongoing and
  queued is what the gateway has in flight on prefill workers plus what they report waiting;
- decode: wants enough replicas to bring KV pool occupancy under ``target_occupancy``, plus one more while
  any admission is queued;
- both clipped to ``[min_replicas, max_replicas]``. Scaling up starts actors at once; scaling down waits
  until the lower demand has lasted ``downscale_delay_s``, then drains the least-busy replica: it leaves
  the routing tables, finishes what it has, and only then is its actor stopped. No request is lost.
  A replica younger than ``min_uptime_s`` is never drained (no worker started and stopped within it).

Time is the event loop's (``vlkv simulate`` runs this class unchanged on a virtual clock); the replicas'
processes are reached through ``replicas_api`` (``RayReplicas``: Ray actors; the simulator: simulated ones).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import ray
from vlkv.services.metrics import record_loads
from vlkv.services.router import Router

log = logging.getLogger(__name__)


@dataclass
class PoolSpec:
    """Bounds and scaling target of one worker pool."""

    min_replicas: int = 1
    max_replicas: int = 1
    target: float = 2.0  # prefill: ongoing+queued per replica; decode: pool occupancy share (0, 1]
    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {"vlkv_decode": 1} to pin a node group

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if self.target <= 0:
            raise ValueError("target must be > 0")


@dataclass(eq=False)
class Replica:
    kind: str
    actor: object
    address: str = ""
    state: str = "starting"  # starting -> serving -> draining -> gone
    misses: int = 0
    started_at: float = 0.0  # event-loop time it started serving


class RayReplicas:
    """What the autoscaler does to a replica's process, for Ray actors (``deploy/actors.py``)."""

    async def alive(self, r: Replica) -> bool:
        try:
            await asyncio.wait_for(r.actor.address.remote(), timeout=2.0)
            return True
        except Exception:
            return False

    def drain(self, r: Replica) -> None:
        r.actor.drain.remote()

    async def stop(self, r: Replica) -> None:
        try:
            await asyncio.wait_for(r.actor.stop.remote(), timeout=30)
        except Exception as exc:
            log.warning("stopping drained %s worker %s: %s", r.kind, r.address, exc)
        self.kill(r)

    def kill(self, r: Replica) -> None:
        try:
            ray.kill(r.actor)
        except Exception:
            pass


@dataclass
class Event:
    unix_time: float
    kind: str
    action: str
    replicas: int
    reason: str
    at: float = 0.0  # event-loop time
    address: str = ""


@dataclass
class Autoscaler:
    router: Router
    start_actor: object  # async (kind) -> Replica (serving, address known)
    specs: dict[str, PoolSpec]
    interval_s: float = 1.0
    downscale_delay_s: float = 5.0
    min_uptime_s: float = 0.0
    replicas_api: object = field(default_factory=RayReplicas)
    replicas: list[Replica] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    metrics: object = None  # GatewayMetrics to export the loads to
    _low_since: dict[str, float] = field(default_factory=dict)
    _task: asyncio.Task | None = None

    def serving(self, kind: str) -> list[Replica]:
        return [r for r in self.replicas if r.kind == kind and r.state in ("starting", "serving")]

    def _event(self, kind: str, action: str, reason: str, address: str = "") -> None:
        n = len([r for r in self.replicas if r.kind == kind and r.state == "serving"])
        now = asyncio.get_running_loop().time()
        self.events.append(Event(time.time(), kind, action, n, reason, now, address))
        log.info("autoscaler: %s %s -> %d serving (%s)", kind, action, n, reason)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # keep scaling even if one round fails
                log.exception("autoscaler round failed")
            await asyncio.sleep(self.interval_s)

    def desired(self, kind: str) -> int:
        spec = self.specs[kind]
        pool = self.router.prefill if kind == "prefill" else self.router.decode
        live = [w for w in pool.values() if not w.draining]
        if kind == "prefill":
            demand = sum(w.in_flight for w in pool.values()) + sum(w.load.waiting for w in live)
            want = math.ceil(demand / spec.target)
        else:
            total = sum(w.load.total_blocks for w in live)
            used = sum(w.load.total_blocks - w.load.free_blocks for w in live)
            waiting = sum(w.load.waiting for w in live)
            per = total / max(len(live), 1)
            want = math.ceil(used / (spec.target * per)) if per else 0
            want += 1 if waiting else 0
        return max(spec.min_replicas, min(spec.max_replicas, want))

    async def tick(self) -> None:
        if self.metrics is not None:
            record_loads(self.metrics, self.router)
        await self._reap_dead()
        for kind in ("prefill", "decode"):
            await self._scale(kind)
        await self._finish_drains()

    async def _reap_dead(self) -> None:
        for r in [r for r in self.replicas if r.state in ("serving", "draining")]:
            pool = self.router.prefill if r.kind == "prefill" else self.router.decode
            w = pool.get(r.address)
            if w is not None and w.reachable:
                r.misses = 0
                continue
            r.misses += 1
            alive = await self.replicas_api.alive(r)
            if not alive or r.misses >= 3:
                r.state = "gone"
                await self.router.remove(r.address)
                self.replicas_api.kill(r)
                self._event(r.kind, "removed", "worker died or stopped answering", r.address)

    async def _scale(self, kind: str) -> None:
        want = self.desired(kind)
        have = len(self.serving(kind))
        now = asyncio.get_running_loop().time()
        if want > have:
            self._low_since.pop(kind, None)
            await asyncio.gather(
                *(self._add(kind, f"demand for {want} replicas") for _ in range(want - have))
            )
        elif want < have:
            since = self._low_since.setdefault(kind, now)
            if now - since >= self.downscale_delay_s:
                self._low_since.pop(kind, None)
                self._drain_one(kind, f"demand fell to {want} replicas")
        else:
            self._low_since.pop(kind, None)

    async def _add(self, kind: str, reason: str) -> None:
        placeholder = Replica(kind, None)
        self.replicas.append(placeholder)
        try:
            replica = await self.start_actor(kind)
        finally:
            self.replicas.remove(placeholder)
        replica.started_at = asyncio.get_running_loop().time()
        self.replicas.append(replica)
        (self.router.add_prefill if kind == "prefill" else self.router.add_decode)(replica.address)
        self._event(kind, "up", reason, replica.address)

    def _drain_one(self, kind: str, reason: str) -> None:
        pool = self.router.prefill if kind == "prefill" else self.router.decode
        serving = [r for r in self.replicas if r.kind == kind and r.state == "serving"]
        if len(serving) <= self.specs[kind].min_replicas:
            return
        now = asyncio.get_running_loop().time()
        candidates = [r for r in serving if now - r.started_at >= self.min_uptime_s]
        if not candidates:
            return
        victim = min(candidates, key=lambda r: pool[r.address].in_flight if r.address in pool else 0)
        victim.state = "draining"
        self.router.set_draining(victim.address)
        self.replicas_api.drain(victim)
        self._event(kind, "drain", reason, victim.address)

    async def _finish_drains(self) -> None:
        for r in [r for r in self.replicas if r.state == "draining"]:
            pool = self.router.prefill if r.kind == "prefill" else self.router.decode
            w = pool.get(r.address)
            busy = w is not None and (w.in_flight > 0 or w.load.running > 0 or w.load.waiting > 0)
            if busy:
                continue
            r.state = "gone"
            await self.router.remove(r.address)
            await self.replicas_api.stop(r)
            self._event(r.kind, "removed", "drained", r.address)
