"""Prefill side of the NIXL hand-off: gRPC for control, one-sided NIXL writes for the K/V bytes.

``NixlKVSender.send(header, cache)`` on one ``TransferKVNixl`` call (bidirectional stream):

1. -> ``open``: the header (layout, fingerprint, k_l, m, first token, sampling) and the name of the decode
   agent whose metadata we hold; the decode worker validates it and admits the blocks exactly as for gRPC.
2. <- ``regions``: per layer, runs of the blocks allocated for this request (plus the decode agent's
   metadata when ours is missing or stale: a restarted decode worker has a new agent name).
3. each layer (int8 caches: its int8 K/V) is packed into block order in a registered staging buffer (``block_layout.pack_layer``),
   checksummed and checked finite while it is in cache (the decode worker's CRC-32C then proves it holds
   exactly these bytes, so it need not read them a second time), and written into its runs with one NIXL
   WRITE per layer, posted as soon as it is packed, from a ring of ``SLOTS`` layer-sized slots, with a
   notification (``notif_key``) so the decode worker checksums that layer while the next is written.
4. -> ``done`` with the per-layer CRC-32C once every write completed (an int8 cache's fp16 scales ride
   in ``done``, covered by their layer's CRC); <- the ack once the decode worker's
   checksums of what landed match. Any failure before that is a ``KVWireError`` with the decode worker's
   status, or UNAVAILABLE (REFUSAL_HAND_OFF_FAILED) for a transport failure; writes still in flight are
   aborted, and none is posted after the write window the decode worker gave.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import torch
from vlkv.common.errors import Refusal, refusal_of
from vlkv.common.handoff.block_layout import pack_layer, packed_bytes, tensor_crc32c
from vlkv.common.handoff.compact_kv import CompactKV, all_finite
from vlkv.common.handoff.nixl_agent import NixlAgent, NixlError, device_id, mem_type, notif_key
from vlkv.common.handoff.wire import KVWireError, tensor_bytes
from vlkv.v1 import kv_pb2, worker_pb2

TRANSFER_KV_NIXL_METHOD = "/vlkv.v1.DecodeWorker/TransferKVNixl"
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
SLOTS = 2  # staging slots of one packed layer each: layer i is packed while layer i - 1 is written


class StagingPool:
    """Registered host (or device) buffers the sender packs layers into, reused across transfers; at most
    ``keep`` idle buffers stay registered."""

    def __init__(self, agent: NixlAgent, keep: int = 2) -> None:
        self.agent = agent
        self.keep = keep
        self._idle: list[tuple[torch.Tensor, object]] = []

    def acquire(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, object]:
        for i, (buf, _reg) in enumerate(self._idle):
            if buf.numel() >= nbytes and buf.device == device:
                return self._idle.pop(i)
        size = 1 << max(20, (nbytes - 1).bit_length())  # powers of two from 1 MiB: few re-registrations
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        return buf, self.agent.register([buf])

    def release(self, item: tuple[torch.Tensor, object]) -> None:
        self._idle.append(item)
        self._idle.sort(key=lambda it: it[0].numel(), reverse=True)
        while len(self._idle) > self.keep:
            self.agent.deregister(self._idle.pop()[1])


def _descs(rows: list[tuple[int, int]], dev: int) -> np.ndarray:
    out = np.empty((len(rows), 3), dtype=np.uint64)
    for i, (addr, n) in enumerate(rows):
        out[i] = (addr, n, dev)
    return out


class NixlKVSender:
    transport = "nixl"

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        agent: NixlAgent,
        staging: StagingPool,
        *,
        timeout_s: float | None = 60.0,
        layer_delay_s: float = 0.0,
    ) -> None:
        """``address``: the decode worker's (the key its NIXL agent is known under); ``layer_delay_s``:
        fault injection for tests, a pause after each layer's write (the hand-off visibly in flight)."""
        self._call = channel.stream_stream(
            TRANSFER_KV_NIXL_METHOD,
            request_serializer=worker_pb2.NixlTransferRequest.SerializeToString,
            response_deserializer=worker_pb2.NixlTransferReply.FromString,
        )
        self.address = address
        self.agent = agent
        self.staging = staging
        self.timeout_s = timeout_s
        self.layer_delay_s = layer_delay_s

    async def send(self, header: kv_pb2.KVChunk, cache: CompactKV) -> worker_pb2.TransferAck:
        call = self._call(timeout=self.timeout_s)
        try:
            return await self._send(call, header.header, cache)
        except grpc.aio.AioRpcError as err:
            raise KVWireError(err.code(), err.details() or "KV transfer failed", refusal_of(err)) from err
        except NixlError as exc:
            self.agent.forget(self.address)  # reload the peer's metadata next time: it may have restarted
            raise KVWireError(_UNAVAILABLE, str(exc), Refusal.REFUSAL_HAND_OFF_FAILED) from exc
        finally:
            call.cancel()  # no-op once the call ended

    async def _send(self, call, header: kv_pb2.KVHeader, cache: CompactKV) -> worker_pb2.TransferAck:
        known = self.agent.known_peer(self.address)
        await call.write(
            worker_pb2.NixlTransferRequest(open=worker_pb2.NixlOpen(header=header, known_agent=known))
        )
        regions = _part(await call.read(), "regions")  # a refusal raises its status
        deadline = time.monotonic() + regions.write_window_ms / 1000
        peer = self.agent.peer(self.address, regions.agent_name, regions.agent_metadata)
        block = regions.block_size
        _check_regions(regions, cache, block)
        k0 = cache.keys[0]
        sizes = [
            packed_bytes(k.shape[1], block, cache.num_kv_heads, cache.head_dim, k0.element_size())
            for k in cache.keys
        ]
        slot_bytes = 2 * max(sizes)  # one layer's K and V, packed
        staged = self.staging.acquire(SLOTS * slot_bytes, k0.device)
        buf = staged[0]
        mem, dev = mem_type(buf), device_id(buf)
        in_slot: list = [None] * SLOTS  # the write still reading each slot, if any
        crcs: list[int] = []
        ended = asyncio.ensure_future(call.read())  # the decode worker ending the call early stops the writes
        try:
            for layer, (k, v, size, runs) in enumerate(
                zip(cache.keys, cache.values, sizes, regions.layers, strict=True)
            ):
                slot = layer % SLOTS
                if in_slot[slot] is not None:  # the write of layer - SLOTS still reads this slot
                    h, in_slot[slot] = in_slot[slot], None
                    await self.agent.wait([h], deadline, ended.done)
                off = slot * slot_bytes
                local, crc = [], 0
                for src in (k, v):
                    in_slot = _progress(self.agent, in_slot)
                    dst = buf[off : off + size]
                    pack_layer(dst, src, block)
                    crc = tensor_crc32c(dst, crc)  # while the packed bytes are still in cache
                    if not all_finite(dst.view(src.dtype)):
                        raise KVWireError(
                            grpc.StatusCode.INVALID_ARGUMENT, f"the cache holds NaN or inf in layer {layer}"
                        )
                    pos = 0
                    for n in runs.lengths:
                        local.append((dst.data_ptr() + pos, n))
                        pos += n
                    off += size
                if cache.quantized:  # the scales travel in ``done``; the layer's CRC continues over them
                    for t in (cache.k_scales[layer], cache.v_scales[layer]):
                        crc = tensor_crc32c(t.contiguous(), crc)
                        if not all_finite(t):
                            raise KVWireError(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"the cache holds NaN or inf in layer {layer}",
                            )
                remote = [(a, n) for a, n in zip(runs.key_addrs, runs.lengths, strict=True)]
                remote += [(a, n) for a, n in zip(runs.value_addrs, runs.lengths, strict=True)]
                crcs.append(crc)
                if ended.done() or time.monotonic() > deadline:
                    raise NixlError(f"the write window closed at layer {layer}")
                note = notif_key(header.request_id, layer)  # the receiver checksums this layer meanwhile
                in_slot[slot] = self.agent.post(peer, _descs(local, dev), _descs(remote, dev), mem, note)
                if self.layer_delay_s:
                    live, in_slot = [h for h in in_slot if h is not None], [None] * SLOTS
                    await self.agent.wait(live, deadline, ended.done)
                    await asyncio.sleep(self.layer_delay_s)
            live, in_slot = [h for h in in_slot if h is not None], [None] * SLOTS
            await self.agent.wait(live, deadline, ended.done)
        except NixlError:
            if ended.done() and not ended.cancelled():  # the decode worker ended the call: its status
                ended.result()  # raises the call's AioRpcError
            raise
        except BaseException:
            ended.cancel()  # the call itself is cancelled by ``send``
            raise
        finally:
            for h in in_slot:  # aborts writes still in flight (an error before ``wait``)
                if h is not None:
                    self.agent.release(h)
            self.staging.release(staged)
        if ended.done():
            ended.result()  # the call's status, if it ended with one
            raise KVWireError(grpc.StatusCode.INTERNAL, "the decode worker replied before the writes ended")
        done = worker_pb2.NixlDone(layer_crc32c=crcs)
        if cache.quantized:
            done.key_scales.extend(bytes(tensor_bytes(t)) for t in cache.k_scales)
            done.value_scales.extend(bytes(tensor_bytes(t)) for t in cache.v_scales)
        await call.write(worker_pb2.NixlTransferRequest(done=done))
        return _part(await ended, "ack")


def _progress(agent: NixlAgent, in_slot: list) -> list:
    """Progress the writes in flight (UCX over TCP moves bytes only when asked); ``in_slot`` without the
    finished ones, which are released."""
    live = [h for h in in_slot if h is not None]
    agent.poll(live)
    return [h if any(h is x for x in live) else None for h in in_slot]


def _part(reply, want: str):
    """``reply``'s ``want`` part (a call the decode worker ended with a status raised on read)."""
    part = reply.WhichOneof("part") if reply is not grpc.aio.EOF else "the end of the call"
    if part != want:
        raise KVWireError(grpc.StatusCode.INTERNAL, f"expected {want} from the decode worker, got {part}")
    return getattr(reply, want)


def _check_regions(regions: worker_pb2.NixlRegions, cache: CompactKV, block: int) -> None:
    """The decode worker's regions must hold exactly this cache's blocks (a sender bug or a confused
    peer otherwise: no write is posted)."""
    if block < 1 or len(regions.layers) != cache.num_layers:
        raise NixlError(
            f"regions for {len(regions.layers)} layers (block size {block}), cache has {cache.num_layers}"
        )
    for layer, (k, runs) in enumerate(zip(cache.keys, regions.layers, strict=True)):
        want = packed_bytes(k.shape[1], block, cache.num_kv_heads, cache.head_dim, k.element_size())
        n = len(runs.lengths)
        if len(runs.key_addrs) != n or len(runs.value_addrs) != n or sum(runs.lengths) != want:
            raise NixlError(
                f"layer {layer}: regions hold {sum(runs.lengths)} bytes, the layer packs to {want}"
            )
