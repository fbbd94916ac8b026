"""TLS, mutual TLS and bearer-token authentication for vlkv's gRPC servers and channels.

One :class:`SecurityConfig` describes a process: its certificate and key (TLS on every server it runs), the
CA that signed its peers (verify servers; with ``mutual_tls`` also require and verify client certificates
on the internal worker services), the bearer token the public API demands, and the internal token every
internal call carries. TLS off is the local one-machine mode; ``check_exposure`` refuses to run that mode on
a non-loopback address.

Worker ports never take an unauthenticated call, loopback included: internal calls are authenticated by
client certificates (``mutual_tls``) or by the internal token. Every ``ServerConfig`` without mutual TLS
draws a random token when none is given (``draw_internal_token``: ``vlkv serve``, the Ray deployment and the
in-process test cluster alike; Ray ships it to every worker with the rest of the configuration), and every
worker server refuses a call without it (UNAUTHENTICATED; health checks stay open). Internal channels attach
it to every call as call credentials: over TLS, or over local (loopback, unencrypted) channel credentials
in the local mode, where gRPC allows call credentials on loopback connections only.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc
from vlkv.common.errors import ConfigError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
UNAUTHENTICATED_EXEMPT = ("/grpc.health.v1.Health/",)
INTERNAL_TOKEN_KEY = "vlkv-internal-token"  # metadata key of the internal token on worker calls


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    cert: str = ""  # PEM certificate chain of this process
    key: str = ""  # PEM private key
    ca: str = ""  # PEM CA bundle that signed the peers
    mutual_tls: bool = False  # workers require and verify client certificates
    api_token: str = ""  # bearer token required on the public API (empty: none)
    internal_token: str = ""  # shared secret every internal call carries; workers refuse calls without it

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("TLS needs both a certificate and a key")
        if self.mutual_tls and not (self.cert and self.ca):
            raise ConfigError("mutual TLS needs a certificate, a key and a CA bundle")
        for path in (self.cert, self.key, self.ca):
            if path:
                _read(path)

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    def server_credentials(self, *, internal: bool) -> grpc.ServerCredentials | None:
        """TLS credentials for a server; internal (worker) servers require client certs under mutual TLS."""
        if not self.tls:
            return None
        require = self.mutual_tls and internal
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.ca) if require else None,
            require_client_auth=require,
        )

    @property
    def authenticates_workers(self) -> bool:
        """Whether worker ports authenticate their callers (client certificates or the internal token)."""
        return self.mutual_tls or bool(self.internal_token)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for internal channels: verify the server by the CA; present our cert under mTLS;
        attach the internal token (if any) to every call. Without TLS: local (loopback) credentials carrying
        the token, or None (a plain insecure channel) when there is no token either."""
        if not self.tls:
            if not self.internal_token:
                return None
            local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
            token = grpc.metadata_call_credentials(_InternalTokenPlugin(self.internal_token))
            return grpc.composite_channel_credentials(local, token)
        if self.mutual_tls:
            creds = grpc.ssl_channel_credentials(_read(self.ca), _read(self.key), _read(self.cert))
        else:
            creds = grpc.ssl_channel_credentials(_read(self.ca) if self.ca else None)
        if self.internal_token:
            token = grpc.metadata_call_credentials(_InternalTokenPlugin(self.internal_token))
            creds = grpc.composite_channel_credentials(creds, token)
        return creds

    def internal_interceptors(self) -> tuple[grpc.aio.ServerInterceptor, ...]:
        """Interceptors of an internal (worker) server: the internal token check, when one is set."""
        return (InternalTokenInterceptor(self.internal_token),) if self.internal_token else ()

    def check_exposure(self, host: str) -> None:
        """The insecure local mode binds loopback only; exposed worker ports authenticate their callers."""
        if host in LOOPBACK:
            return
        if not (self.tls and self.api_token):
            raise ConfigError(
                f"refusing to serve on {host!r} without TLS and an API token; pass --tls-cert/--tls-key and "
                "--api-token (or bind 127.0.0.1 for the local one-machine mode)"
            )
        if not (self.mutual_tls or self.internal_token):
            raise ConfigError(
                f"refusing to serve on {host!r} with unauthenticated worker ports: pass --mtls (with "
                "--tls-ca), or an internal token (--internal-token or VLKV_INTERNAL_TOKEN)"
            )


def draw_internal_token() -> str:
    """A fresh random internal token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


class _InternalTokenPlugin(grpc.AuthMetadataPlugin):
    """Adds the internal token to every call of an internal channel."""

    def __init__(self, token: str) -> None:
        self._metadata = ((INTERNAL_TOKEN_KEY, token),)

    def __call__(self, context, callback) -> None:
        callback(self._metadata, None)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata ``key`` is not ``expected`` with UNAUTHENTICATED (health checks exempt)."""

    def __init__(self, key: str, expected: str, what: str) -> None:
        self._key = key
        self._expected = expected.encode()
        self._message = f"missing or invalid {what}"

    def _deny(self, handler):
        msg = self._message

        async def unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        async def streaming(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
            yield  # pragma: no cover - makes this an async generator

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        key = (handler.request_streaming, handler.response_streaming)
        return kinds[key](streaming if key[1] else unary)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_EXEMPT):
            return await continuation(handler_call_details)
        got = dict(handler_call_details.invocation_metadata or ()).get(self._key, "")
        if isinstance(got, str) and hmac.compare_digest(got.encode(), self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else self._deny(handler)


class BearerTokenInterceptor(TokenInterceptor):
    """The public API's check: ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        super().__init__("authorization", f"Bearer {token}", "bearer token")


class InternalTokenInterceptor(TokenInterceptor):
    """A worker's check: the internal token (``INTERNAL_TOKEN_KEY``) that internal channels attach."""

    def __init__(self, token: str) -> None:
        super().__init__(INTERNAL_TOKEN_KEY, token, "internal token")
