"""Shared set-up of vlkv's grpc.aio servers: message limits, health checking, reflection, errors."""

from __future__ import annotations

import functools
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from vlkv.common.errors import VlkvError, abort_with

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """Client side: ping the peer every ``keepalive_s`` while calls are open and close the connection when
    a ping is not answered within ``keepalive_s``, so calls to a hung or vanished process (SIGSTOP, a dead
    host, a silent network partition) fail with UNAVAILABLE instead of waiting for ever. 0: off."""
    if keepalive_s <= 0:
        return []
    ms = max(1, int(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # any ping in flight (BDP probes too) times out as fast
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging on a quiet server stream
        ("grpc.keepalive_permit_without_calls", 0),
    ]


# Server side of internal keepalive: answer a peer's pings however often it sends them (the default answers
# a ping sent sooner than 5 minutes after the last one with a GOAWAY after two such "strikes").
ACCEPT_PINGS = [("grpc.http2.max_ping_strikes", 0)]


class Server:
    """A grpc.aio server with the standard health service and reflection for ``service_names``."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: list[str],
        max_message_bytes: int,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: tuple = (),
        accept_pings: bool = False,
    ) -> None:
        """``accept_pings``: an internal server, whose peers keep connections alive (``keepalive_options``)."""
        options = channel_options(max_message_bytes) + (ACCEPT_PINGS if accept_pings else [])
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [
                *service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        bind = f"{host}:{port}"
        if credentials is None:
            self.port = self.server.add_insecure_port(bind)
        else:
            self.port = self.server.add_secure_port(bind, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def make_channel(
    address: str, security, max_message_bytes: int, keepalive_s: float = 0.0
) -> grpc.aio.Channel:
    """An internal channel: TLS (with our client certificate under mutual TLS) when configured, and
    keepalive pings (``keepalive_options``)."""
    options = channel_options(max_message_bytes) + keepalive_options(keepalive_s)
    creds = security.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


def make_sync_channel(address: str, security, max_message_bytes: int = 64 << 20) -> grpc.Channel:
    """A blocking channel to a worker with the same credentials (the internal token included): for tools
    and tests that query worker ports directly."""
    options = channel_options(max_message_bytes)
    creds = security.channel_credentials()
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)


def abort_on_error(method):
    """Turn a VlkvError raised by a unary handler into the call's gRPC status.

    The abort is raised outside the ``except`` block, with no reference to the request left in this frame:
    gRPC keeps the abort's traceback for a while, and a traceback that reached the handler's frames would
    keep a large refused request (tens of MB) alive with it."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except VlkvError as exc:
            error = (exc.code, exc.message, exc.reason)
        request = None  # noqa: F841 - drop this frame's reference before the abort's traceback takes it
        await abort_with(context, *error)

    return wrapper


def abort_stream_on_error(method):
    """The same for server-streaming handlers (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
        except VlkvError as exc:
            await abort_with(context, exc.code, exc.message, exc.reason)

    return wrapper
