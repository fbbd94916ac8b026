"""The hand-off seam: what a prefill worker sends through and how a worker picks its KV transport.

Senders (``KVSender``): ``grpc_transport.GrpcKVSender`` (K/V in ``TransferKV`` messages) and
``nixl_sender.NixlKVSender`` (header and control over ``TransferKVNixl``, K/V written by NIXL straight into
the decode pool). Both take the header chunk (``wire.encode_header``) and the ``CompactKV``, and both raise
``KVWireError`` with the decode worker's status and refusal reason. The receiving side of both is
``decode_worker/grpc_receiver.py`` and ``nixl_receiver.py``, which both end in ``decode_worker/admission.py``.

``--kv-transport``: ``grpc``; ``nixl`` (a worker that cannot load NIXL refuses to start); ``auto``: NIXL where
it loads and TLS is off (NIXL bytes are not encrypted), else gRPC. A prefill worker on ``auto`` whose decode
peer does not offer NIXL (``REFUSAL_TRANSPORT_UNAVAILABLE``) sends that peer's caches over gRPC instead.
"""

from __future__ import annotations

from typing import Protocol

from vlkv.common.errors import ConfigError
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.nixl_agent import NixlAgent, NixlError, nixl_available
from vlkv.v1 import kv_pb2, worker_pb2


class KVSender(Protocol):
    transport: str  # "grpc" or "nixl"

    async def send(self, header: kv_pb2.KVChunk, cache: CompactKV) -> worker_pb2.TransferAck:
        """Hand ``cache`` (described by ``header``) to the decode worker; raise KVWireError on refusal."""
        ...


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
