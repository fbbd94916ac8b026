"""The hand-off seam: what a prefill worker sends through, what a decode worker receives through, and how a
worker picks its KV transport.

Senders (``KVSender``): ``grpc_transport.GrpcKVSender`` (K/V in ``TransferKV`` messages) and
``nixl_sender.NixlKVSender`` (header and control over ``TransferKVNixl``, K/V written by NIXL straight into
the decode pool). Both take the header chunk (``wire.encode_header``) and the ``CompactKV``, and both raise
``KVWireError`` with the decode worker's status and refusal reason.

Receivers (``KVReceiver``): ``decode_worker/grpc_receiver.py`` ``GrpcKVReceiver`` and ``nixl_receiver.py``
``NixlKVReceiver``, each the handler of its transport's RPC, both ending in ``decode_worker/admission.py``
(admit -> write -> arrive). While a cache is on its way its hand-off is a ``Transfer``, which the decode
worker's rendezvous can abandon when the request is given up.

``--kv-transport``: ``grpc``; ``nixl`` (a worker that cannot load NIXL refuses to start); ``auto``: NIXL where
it loads and TLS is off (NIXL bytes are not encrypted), else gRPC. A prefill worker on ``auto`` whose decode
peer does not offer NIXL (``REFUSAL_TRANSPORT_UNAVAILABLE``) sends that peer's caches over gRPC instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, runtime_checkable

from vlkv.common.errors import ConfigError
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.nixl_agent import NixlAgent, NixlError, nixl_available
from vlkv.v1 import kv_pb2, worker_pb2


class KVSender(Protocol):
    transport: str  # "grpc" or "nixl"

    async def send(self, header: kv_pb2.KVChunk, cache: CompactKV) -> worker_pb2.TransferAck:
        """Hand ``cache`` (described by ``header``) to the decode worker; raise KVWireError on refusal."""
        ...


@runtime_checkable
class KVReceiver(Protocol):
    """The decode side of a transport: ``receive`` serves its RPC (``grpc``: ``TransferKV``, a client stream
    answered by one ``TransferAck``; ``nixl``: ``TransferKVNixl``, a bidirectional stream of
    ``NixlTransferReply`` whose last carries the ack). A cache that passes admission ends whole in the pool
    and arrives for its ``Decode`` call; anything else frees its blocks and aborts the call with the status
    and ``Refusal`` reason the sender raises as ``KVWireError``."""

    transport: str  # "grpc" or "nixl", as the sender's

    def receive(
        self, requests: AsyncIterator, context
    ) -> Awaitable[worker_pb2.TransferAck] | AsyncIterator[worker_pb2.NixlTransferReply]:
        """Serve one hand-off: ``requests`` are the sender's messages, ``context`` the call's."""
        ...


class Transfer(Protocol):
    """One hand-off a receiver has admitted and is still writing (the rendezvous holds it by request id)."""

    def abandon(self) -> None:
        """The request was given up: stop and free what it holds as soon as that is safe."""


def nixl_agent_for(role: str, kv_transport: str, tls: bool) -> NixlAgent | None:
    """This worker's NIXL agent if it uses NIXL, else None; ConfigError when ``nixl`` was asked for and
    cannot load (a clear error at start-up rather than failed hand-offs later)."""
    if kv_transport == "grpc" or (kv_transport == "auto" and tls):
        return None
    why = nixl_available()
    if not why:
        try:
            return NixlAgent(role)
        except NixlError as exc:
            why = str(exc)
    if kv_transport == "nixl":
        raise ConfigError(f"--kv-transport nixl: {why}")
    return None
