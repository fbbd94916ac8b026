"""A one-machine vlkv cluster: Ray places the prefill and decode workers as actors, the gateway runs here.

``LocalCluster`` starts (or joins) Ray, launches ``num_prefill`` prefill and ``num_decode`` decode actors,
waits until each reports its gRPC address, and serves the public API from this process. ``stop`` drains the
gateway, stops the workers gracefully and kills their actors.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray
from vlkv.common.config import ServerConfig
from vlkv.deploy.actors import DecodeActor, PrefillActor
from vlkv.services.app import Running, start_gateway

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join ``address`` or start a local Ray; a busy machine gets more time to bring up the raylet."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False, log_to_driver=True)


class LocalCluster:
    def __init__(
        self,
        cfg: ServerConfig,
        *,
        num_prefill: int = 1,
        num_decode: int = 1,
        gateway_port: int = 0,
        worker_cpus: float = 1.0,
        ray_address: str | None = None,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode worker")
        self.cfg = cfg
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.gateway_port = gateway_port
        self.worker_cpus = worker_cpus
        self.ray_address = ray_address
        self.actors: list = []
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.gateway: Running | None = None

    async def start(self) -> str:
        init_ray(self.ray_address)
        opts = {"num_cpus": self.worker_cpus}
        prefill = [PrefillActor.options(**opts).remote() for _ in range(self.num_prefill)]
        decode = [DecodeActor.options(**opts).remote() for _ in range(self.num_decode)]
        self.actors = prefill + decode
        try:
            self.prefill_addresses = list(await asyncio.gather(*(a.start.remote(self.cfg) for a in prefill)))
            self.decode_addresses = list(await asyncio.gather(*(a.start.remote(self.cfg) for a in decode)))
            self.gateway = await start_gateway(
                self.cfg, self.prefill_addresses, self.decode_addresses, port=self.gateway_port
            )
        except BaseException:
            await self.stop()
            raise
        log.info(
            "vlkv gateway on %s; prefill %s; decode %s",
            self.address,
            self.prefill_addresses,
            self.decode_addresses,
        )
        return self.address

    @property
    def address(self) -> str:
        return self.gateway.address if self.gateway else ""

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None
        for actor in self.actors:
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=self.cfg.grace_s + 10)
            except Exception as exc:  # a dead actor has nothing left to stop
                log.warning("stopping actor failed: %s", exc)
            ray.kill(actor)
        self.actors = []
