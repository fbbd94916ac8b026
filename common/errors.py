"""Errors that carry the gRPC status they should end a call with, and a machine-readable refusal reason.

A worker that refuses a call for a reason its caller acts on (pool full: re-queue; hand-off failed: do not
retry the prefill) sends ``worker_pb2.Refusal`` as the trailing metadata ``vlkv-refusal`` beside the
status (``refusal_metadata``); the caller reads it back with ``refusal_of``. Messages stay for humans.
"""

from __future__ import annotations

import grpc
from vlkv.v1 import worker_pb2

REFUSAL_KEY = "vlkv-refusal"
Refusal = worker_pb2.Refusal


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


class VlkvError(Exception):
    """An error with a defined gRPC status code (and optional refusal reason); servers abort with it."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, reason: int = Refusal.REFUSAL_UNSPECIFIED
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.reason = reason

    @property
    def message(self) -> str:
        return str(self)


class InvalidInput(VlkvError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(VlkvError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(VlkvError):
    code = grpc.StatusCode.UNAVAILABLE


def refusal_metadata(reason: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that names ``reason`` (empty for REFUSAL_UNSPECIFIED)."""
    if reason == Refusal.REFUSAL_UNSPECIFIED:
        return ()
    return ((REFUSAL_KEY, Refusal.Name(reason)),)


def refusal_of(err: grpc.aio.AioRpcError) -> int:
    """The refusal reason a failed call's trailing metadata names; REFUSAL_UNSPECIFIED if none or unknown."""
    for key, value in err.trailing_metadata() or ():
        if key == REFUSAL_KEY:
            try:
                return Refusal.Value(value)
            except ValueError:
                return Refusal.REFUSAL_UNSPECIFIED
    return Refusal.REFUSAL_UNSPECIFIED


async def abort_with(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: int
) -> None:
    """End the call with ``code`` and ``message``, naming ``reason`` in the trailing metadata."""
    metadata = refusal_metadata(reason)
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(code, message)
