"""A vlkv cluster: Ray places prefill and decode workers as actors; the gateway and autoscaler run here.

``LocalCluster`` starts (or joins) Ray, launches each pool's ``min_replicas`` actors, serves the public
API (and the Admin status API) from this process, and runs the autoscaler, which grows and drains the
pools between their bounds. ``stop`` stops the gateway, then every worker, gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray
from vlkv.common.config import ServerConfig
from vlkv.common.errors import ConfigError
from vlkv.deploy.actors import DecodeActor, PrefillActor
from vlkv.deploy.autoscaler import Autoscaler, PoolSpec, Replica
from vlkv.deploy.placement import placement_problems
from vlkv.deploy.servers import Running, start_gateway, start_http_front
from vlkv.services.http_front import HttpFrontConfig
from vlkv.services.http_server import HttpServer

log = logging.getLogger(__name__)
START_ATTEMPTS = 3  # local Ray start-ups tried before giving up


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join ``address`` or start a local Ray (a start that times out on a busy machine is tried again)."""
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):  # an existing cluster (or inside `ray job submit`)
        ray.init(address=address or os.environ["RAY_ADDRESS"])
        return
    # Ray waits a fixed 30 s for a new raylet to register and a fixed time for the GCS port file (neither
    # configurable in this release); on a loaded host either can run out ("The current node timed out
    # during startup", "Timed out waiting for file ..."), so a local start is tried again after shutting the
    # half-started node down.
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False, log_to_driver=True)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception/RuntimeError for these
            if "timed out" not in str(exc).lower() or attempt == START_ATTEMPTS:
                raise
            log.warning("local Ray did not start (attempt %d of %d): %s", attempt, START_ATTEMPTS, exc)
            ray.shutdown()


class LocalCluster:
    def __init__(
        self,
        cfg: ServerConfig,
        *,
        prefill: PoolSpec | None = None,
        decode: PoolSpec | None = None,
        gateway_port: int = 0,
        metrics_port: int | None = None,
        http_port: int | None = None,
        http_front: HttpFrontConfig | None = None,
        ray_address: str | None = None,
        interval_s: float = 1.0,
        downscale_delay_s: float = 10.0,
    ) -> None:
        self.cfg = cfg
        self.specs = {"prefill": prefill or PoolSpec(), "decode": decode or PoolSpec()}
        self.gateway_port = gateway_port
        self.metrics_port = metrics_port
        self.http_port = http_port  # the OpenAI-compatible HTTP front (None: off)
        self.http_front = http_front
        self.http: HttpServer | None = None
        self.ray_address = ray_address
        self.interval_s = interval_s
        self.downscale_delay_s = downscale_delay_s
        self.gateway: Running | None = None
        self.autoscaler: Autoscaler | None = None
        self._metrics_http = None
        self._decode_addresses: set[str] = set()
        self._prefill_actors: list = []

    async def _start_actor(self, kind: str) -> Replica:
        spec = self.specs[kind]
        cls = PrefillActor if kind == "prefill" else DecodeActor
        actor = cls.options(num_cpus=spec.cpus, num_gpus=spec.gpus, resources=spec.resources).remote()
        try:
            address = await actor.start.remote(self.cfg)
        except BaseException:
            ray.kill(actor)
            raise
        # Prefill workers dial only registered decode workers: tell every prefill worker of every decode one.
        if kind == "decode":
            self._decode_addresses.add(address)
            await asyncio.gather(
                *(a.allow_decode.remote(address) for a in self._prefill_actors), return_exceptions=True
            )
        else:
            self._prefill_actors.append(actor)
            await asyncio.gather(*(actor.allow_decode.remote(a) for a in list(self._decode_addresses)))
        return Replica(kind, actor, address, state="serving")

    def _check_placement(self) -> None:
        """ConfigError naming what the pools ask that Ray lacks (a warning on a joined cluster, which an
        autoscaler may still grow)."""
        joined = bool(self.ray_address or os.environ.get("RAY_ADDRESS"))
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        problems = placement_problems(self.specs, ray.cluster_resources(), nodes)
        if not problems:
            return
        if joined:
            for problem in problems:
                log.warning("%s (waiting for the cluster to grow)", problem)
            return
        raise ConfigError("refusing to start: " + "; ".join(problems))

    async def start(self) -> str:
        init_ray(self.ray_address)
        self._check_placement()
        first = await asyncio.gather(
            *(self._start_actor(k) for k, spec in self.specs.items() for _ in range(spec.min_replicas)),
            return_exceptions=True,
        )
        started = [r for r in first if isinstance(r, Replica)]
        failed = [r for r in first if isinstance(r, BaseException)]
        if failed:
            for r in started:
                ray.kill(r.actor)
            raise failed[0]
        self.gateway = await start_gateway(
            self.cfg,
            [r.address for r in started if r.kind == "prefill"],
            [r.address for r in started if r.kind == "decode"],
            port=self.gateway_port,
        )
        gw = self.gateway.servicer
        self.autoscaler = Autoscaler(
            gw.router,
            self._start_actor,
            self.specs,
            self.interval_s,
            self.downscale_delay_s,
            replicas=started,
        )
        self.gateway.attach_admin(self.autoscaler)
        if self.http_port is not None:
            self.http = await start_http_front(self.gateway, self.http_port, self.cfg, self.http_front)
        self.autoscaler.start()
        if self.metrics_port is not None:
            from vlkv.services.metrics import serve_metrics

            self._metrics_http = serve_metrics(gw.metrics, self.metrics_port, self.cfg.host)
        log.info("vlkv gateway on %s", self.address)
        return self.address

    @property
    def address(self) -> str:
        return self.gateway.address if self.gateway else ""

    def replica_count(self, kind: str) -> int:
        return len([r for r in self.autoscaler.replicas if r.kind == kind and r.state == "serving"])

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http = None
        replicas = self.autoscaler.replicas if self.autoscaler else []
        for r in replicas:
            if r.actor is None or r.state == "gone":
                continue
            try:
                await asyncio.wait_for(r.actor.stop.remote(), timeout=self.cfg.grace_s + 10)
            except Exception as exc:  # a dead actor has nothing left to stop
                log.warning("stopping %s worker %s failed: %s", r.kind, r.address, exc)
            ray.kill(r.actor)
            r.state = "gone"
