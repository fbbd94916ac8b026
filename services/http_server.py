"""The HTTP plumbing of the OpenAI-compatible front: uvicorn in the gateway's event loop, and a body limit.

``HttpServer`` serves an ASGI app (``http_front.create_app``) on ``host:port`` inside the running event loop
(the router's gRPC channels live there), with the gateway's TLS certificate when it has one, and without
uvicorn's own signal handling (the process that runs the gateway owns SIGINT and SIGTERM). ``BodyLimit``
answers 413 for a body over the limit, by Content-Length or as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn
from fastapi.responses import JSONResponse
from vlkv.common.security import SecurityConfig
from vlkv.services.openai_schema import ApiError


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length, or as it arrives)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"the request body is over the limit of {self.max_bytes} bytes", "request_too_large"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            err = self._too_large() if length.isdigit() else ApiError(400, "bad Content-Length")
            return await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, limited, send)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the process that runs the gateway owns SIGINT/SIGTERM and stops this server itself


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` (0: any free port) in the running event loop."""

    def __init__(self, app, host: str, port: int, security: SecurityConfig, grace_s: float = 5.0) -> None:
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            ssl_certfile=security.cert or None,
            ssl_keyfile=security.key or None,
            lifespan="on",  # the app's shutdown closes its image fetcher's connections
            ws="none",
            access_log=False,
            log_level="warning",
            server_header=False,
            timeout_graceful_shutdown=max(1, round(grace_s)),
        )
        self.tls = security.tls
        self.server = _Uvicorn(self.config)
        self._task: asyncio.Task | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (what ``openai.OpenAI(base_url=...)`` takes)."""
        return f"{'https' if self.tls else 'http'}://{self.config.host}:{self.port}/v1"

    async def start(self) -> None:
        sock = self.config.bind_socket()
        self.port = sock.getsockname()[1]
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP front did not start on {self.config.host}:{self.port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, let open requests finish for the grace period, then cancel them."""
        if self._task is None:
            return
        self.server.should_exit = True
        await self._task
        self._task = None
