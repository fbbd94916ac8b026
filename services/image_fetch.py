"""Remote image URLs of the HTTP front: fetched with aiohttp on the event loop, bounded in time, size and fan-out.

Only ``http(s)`` URLs whose host is on the allow-list are dialled. Each fetch has one deadline for the whole
of it (waiting for a connection slot, connecting, the headers and the body together), reads the body as it
streams and stops at ``max_bytes``, and holds at most ``per_host`` connections to one host and port (aiohttp's
connector limits; ``total`` over all hosts). Redirects are followed by hand, at most ``max_redirects``, each
target checked against the allow-list before it is dialled. The fetches are coroutines, not threads: a slow
host holds only its own connections, never a thread another host's fetch or a data-URL request needs.

Failures answer in OpenAI's error shape: 400 for a URL that cannot be fetched (host not allowed, redirect
off the list, refused connection, an error status), 413 for an image over the limit, 504 when the host does
not deliver the whole image within the deadline. Each fetch is counted in the gateway's metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import aiohttp
from vlkv.services.openai_schema import ApiError

REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True, slots=True)
class FetchConfig:
    allow_hosts: tuple[str, ...] = ()  # hosts whose http(s) image URLs are fetched; none by default
    deadline_s: float = 10.0  # one fetch, start to last byte (redirects included)
    per_host: int = 4  # connections to one host:port at a time; more fetches wait (within their deadline)
    total: int = 64  # connections to all hosts at a time
    max_redirects: int = 3


class _Failed(ApiError):
    def __init__(self, reason: str, status: int, message: str, code: str = "invalid_image_url") -> None:
        super().__init__(status, message, code)
        self.reason = reason


class ImageFetcher:
    """Fetches allowed remote images; ``close`` releases its connections (the app's shutdown calls it)."""

    def __init__(self, cfg: FetchConfig, metrics=None) -> None:
        self.cfg = cfg
        self.metrics = metrics  # GatewayMetrics (image_fetches, image_fetch_failures, image_fetch_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.cfg.total, limit_per_host=self.cfg.per_host)
            # trust_env=False: no proxy from the environment, so the host checked is the host dialled
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False, raise_for_status=False
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def check(self, url: str) -> None:
        """400 unless ``url`` is http(s) on an allowed host (nothing is dialled)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise _Failed("scheme", 400, "image URLs must be data: URLs (PNG or JPEG)")
        if parts.hostname not in self.cfg.allow_hosts:
            raise _Failed(
                "not_allowed",
                400,
                f"remote image URLs are not fetched (host {parts.hostname!r} is not allowed); send the image "
                "as a data:image/png;base64,... URL",
            )

    async def fetch(self, url: str, max_bytes: int) -> bytes:
        """The bytes at ``url`` (an allowed http(s) URL), within the deadline and ``max_bytes``."""
        start = time.perf_counter()
        reason = "ok"
        try:
            self.check(url)
            return await self._fetch(url, max_bytes)
        except _Failed as exc:
            reason = exc.reason
            raise
        except asyncio.CancelledError:
            reason = "cancelled"
            raise
        finally:
            self._count(reason, time.perf_counter() - start)

    def _count(self, reason: str, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.image_fetches.inc()
        self.metrics.image_fetch_seconds.observe(seconds)
        if reason != "ok":
            self.metrics.image_fetch_failures.labels(reason).inc()

    async def _fetch(self, url: str, max_bytes: int) -> bytes:
        deadline = self.cfg.deadline_s
        timeout = aiohttp.ClientTimeout(total=deadline)
        session = self._client()
        try:
            # wait_for is the authority on the deadline (aiohttp's own total timeout may round up)
            return await asyncio.wait_for(self._follow(session, url, max_bytes, timeout), deadline)
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            host = urlsplit(url).netloc
            raise _Failed(
                "timeout", 504, f"image host {host} did not send the image within {deadline:g} s",
                "deadline_exceeded",
            ) from None  # fmt: skip
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise _Failed(
                "connect", 400, f"cannot fetch image {url!r}: {exc or type(exc).__name__}"
            ) from None

    async def _follow(self, session, url: str, max_bytes: int, timeout) -> bytes:
        for _ in range(self.cfg.max_redirects + 1):
            async with session.get(url, allow_redirects=False, timeout=timeout) as resp:
                if resp.status in REDIRECTS and "location" in resp.headers:
                    target = urljoin(url, resp.headers["location"])
                    try:
                        self.check(target)
                    except _Failed as exc:
                        raise _Failed("redirect_refused", 400, f"redirect refused: {exc.message}") from None
                    url = target
                    continue
                if resp.status != 200:
                    raise _Failed("status", 400, f"image host answered {resp.status} for {url!r}")
                if (resp.content_length or 0) > max_bytes:
                    raise _too_large(max_bytes)
                return await _read(resp, max_bytes)
        raise _Failed("redirects", 400, f"more than {self.cfg.max_redirects} redirects for an image URL")


def _too_large(max_bytes: int) -> ApiError:
    return _Failed("too_large", 413, f"an image is over the limit of {max_bytes} bytes", "request_too_large")


async def _read(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    out = bytearray()
    async for chunk in resp.content.iter_chunked(64 << 10):
        out += chunk
        if len(out) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(out)
