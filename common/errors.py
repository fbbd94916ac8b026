"""Errors that carry the gRPC status they should end a call with."""

from __future__ import annotations

import grpc


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


class VlkvError(Exception):
    """An error with a defined gRPC status code; servers abort the call with it."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidInput(VlkvError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(VlkvError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(VlkvError):
    code = grpc.StatusCode.UNAVAILABLE
