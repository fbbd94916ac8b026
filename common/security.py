"""TLS, mutual TLS and bearer-token authentication for vlkv's gRPC servers and channels.

One :class:`SecurityConfig` describes a process: its certificate and key (TLS on every server it runs), the
CA that signed its peers (verify servers; with ``mutual_tls`` also require and verify client certificates
on the internal worker services), and the bearer token the public API demands. Everything off is the
local one-machine mode; ``check_exposure`` refuses to run that mode on a non-loopback address.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc
from vlkv.common.errors import ConfigError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
UNAUTHENTICATED_EXEMPT = ("/grpc.health.v1.Health/",)


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

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for internal channels: verify the server by the CA; present our cert under mTLS."""
        if not self.tls:
            return None
        if self.mutual_tls:
            return grpc.ssl_channel_credentials(_read(self.ca), _read(self.key), _read(self.cert))
        return grpc.ssl_channel_credentials(_read(self.ca) if self.ca else None)

    def check_exposure(self, host: str) -> None:
        """The insecure local mode binds loopback only."""
        if host not in LOOPBACK and not (self.tls and self.api_token):
            raise ConfigError(
                f"refusing to serve on {host!r} without TLS and an API token; pass --tls-cert/--tls-key and "
                "--api-token (or bind 127.0.0.1 for the local one-machine mode)"
            )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED (health checks exempt)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    @staticmethod
    def _deny(handler):
        msg = "missing or invalid bearer token"

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
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else self._deny(handler)
