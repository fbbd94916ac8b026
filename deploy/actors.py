"""Ray actors that host vlkv's worker servers, one server per actor process.

An actor is an async Ray actor: its event loop runs the worker's grpc.aio server, so after ``start``
returns the worker keeps serving while the actor lives. Ray places the actor by its resource request
(CPUs here, a GPU each on a GPU cluster) and restarts it if its process dies.
"""

from __future__ import annotations

import logging

import ray
from vlkv.common.config import ServerConfig


def _setup_logging() -> None:
    from vlkv.common.logs import setup_logging

    setup_logging(logging.INFO, json_lines=True)


class _WorkerActor:
    kind = ""

    def __init__(self) -> None:
        self._running = None

    async def start(self, cfg: ServerConfig, port: int = 0) -> str:
        _setup_logging()
        from vlkv.deploy import servers as app

        starter = app.start_prefill_worker if self.kind == "prefill" else app.start_decode_worker
        self._running = await starter(cfg, port)
        return self._running.address

    async def address(self) -> str:
        return self._running.address if self._running else ""

    async def allow_decode(self, address: str) -> None:
        """A prefill worker: register a decode worker of the cluster (only registered ones are dialled)."""
        if self._running is not None and hasattr(self._running.servicer, "allow_decode"):
            self._running.servicer.allow_decode(address)

    async def drain(self) -> None:
        """Take no new work (the gateway has already stopped routing here); finish what is running."""
        if self._running is not None:
            self._running.servicer.draining = True

    async def stop(self) -> None:
        if self._running is not None:
            await self._running.stop()
            self._running = None


@ray.remote(max_restarts=0)
class PrefillActor(_WorkerActor):
    kind = "prefill"


@ray.remote(max_restarts=0)
class DecodeActor(_WorkerActor):
    kind = "decode"
