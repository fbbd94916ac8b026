"""The decode workers a prefill worker may send caches to, the channels it keeps to them, and the sender each
gets (the ``transport.KVSender`` seam).

Only registered decode workers are dialled: those in ``TransferConfig.decode_peers`` and those the deployment
adds at run time (``allow``); in local mode (no TLS, so nothing is exposed beyond this host) any loopback
address is allowed too. A request naming any other address is refused (PERMISSION_DENIED) without a
connection attempt. At most ``max_peers`` channels stay open (least recently used closed first).

Transport per peer: ``nixl`` first when this worker has a NIXL agent, unless the peer said it does not offer
NIXL (``REFUSAL_TRANSPORT_UNAVAILABLE`` or an older worker's UNIMPLEMENTED), after which ``auto`` sends that
peer's caches over gRPC; ``nixl`` alone keeps the refusal as the request's status. ``auto`` also sends caches
smaller than ``transfer.nixl_min_bytes`` over gRPC (NIXL's extra round trip costs more than it saves there).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc
from vlkv.common.config import PrefillConfig
from vlkv.common.errors import Refusal, VlkvError
from vlkv.common.grpc_server import make_channel
from vlkv.common.handoff.grpc_transport import GrpcKVSender
from vlkv.common.handoff.nixl_agent import NixlAgent
from vlkv.common.handoff.nixl_sender import NixlKVSender, StagingPool
from vlkv.common.handoff.transport import KVSender
from vlkv.common.handoff.wire import KVWireError

log = logging.getLogger(__name__)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


class DecodePeers:
    def __init__(self, cfg: PrefillConfig, nixl: NixlAgent | None = None) -> None:
        self.cfg = cfg
        self.nixl = nixl
        self.staging = StagingPool(nixl) if nixl is not None else None
        self.registered: set[str] = set(cfg.transfer.decode_peers)
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._grpc_only: set[str] = set()  # peers that do not offer NIXL (auto falls back)
        self._closing: set[asyncio.Task] = set()

    def allow(self, address: str) -> None:
        self.registered.add(address)

    def forget(self, address: str) -> None:
        self.registered.discard(address)
        self._close(address)

    def permitted(self, address: str) -> bool:
        return address in self.registered or (not self.cfg.security.tls and is_loopback(address))

    def channel(self, address: str) -> grpc.aio.Channel:
        if not self.permitted(address):
            raise VlkvError(
                f"decode worker {address} is not registered with this prefill worker",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        ch = self._channels.get(address)
        if ch is None:
            c = self.cfg
            ch = make_channel(address, c.security, c.limits.max_message_bytes, c.keepalive_s)
            self._channels[address] = ch
            while len(self._channels) > c.transfer.max_peers:
                self._close(next(iter(self._channels)))
        self._channels.move_to_end(address)
        return ch

    def senders(self, address: str, nbytes: int | None = None) -> list[KVSender]:
        """The senders to try for ``address``, in order (a NIXL one first where it may be used). Under
        ``auto`` a cache of fewer than ``transfer.nixl_min_bytes`` bytes goes over gRPC."""
        t = self.cfg.transfer
        ch = self.channel(address)
        delay = t.fault_chunk_delay_ms / 1000
        grpc_sender = GrpcKVSender(ch, chunk_bytes=t.chunk_bytes, timeout_s=t.deadline_s, chunk_delay_s=delay)
        small = t.kv_transport == "auto" and nbytes is not None and nbytes < t.nixl_min_bytes
        if self.nixl is None or address in self._grpc_only or small:
            return [grpc_sender]
        nixl = NixlKVSender(ch, address, self.nixl, self.staging, timeout_s=t.deadline_s, layer_delay_s=delay)
        return [nixl] if t.kv_transport == "nixl" else [nixl, grpc_sender]

    async def send(self, address: str, header, cache):
        """Hand ``cache`` to ``address`` through its senders in order (NIXL, then gRPC where ``auto`` falls
        back); the last refusal or failure is raised as KVWireError."""
        senders = self.senders(address, cache.nbytes)
        for i, sender in enumerate(senders):
            try:
                return await sender.send(header, cache)
            except KVWireError as exc:
                if i + 1 < len(senders) and self.transport_refused(address, exc):
                    continue
                raise
        raise AssertionError("unreachable: senders() is never empty")

    def transport_refused(self, address: str, exc: KVWireError) -> bool:
        """Whether ``exc`` says the peer does not offer NIXL; remembered so ``auto`` goes to gRPC for it."""
        refused = (
            exc.reason == Refusal.REFUSAL_TRANSPORT_UNAVAILABLE or exc.code == grpc.StatusCode.UNIMPLEMENTED
        )
        if refused:
            log.info("decode worker %s does not offer NIXL; its caches go over gRPC", address)
            self._grpc_only.add(address)
        return refused

    def _close(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        self._grpc_only.discard(address)
        if ch is not None:  # calls in flight may finish within the hand-off deadline
            task = asyncio.get_running_loop().create_task(ch.close(self.cfg.transfer.deadline_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
