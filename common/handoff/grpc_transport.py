"""The gRPC KV transport: the cache's bytes in client-streaming ``TransferKV`` messages.

``GrpcKVSender.send(header, cache)`` (the ``transport.KVSender`` seam) takes the header chunk (from
``wire.encode_header``) and a ``CompactKV`` or an iterable of per-layer ``(K, V)`` that may still be producing
later layers while earlier ones are on the wire. A ``CompactKV`` of at most ``bundle_bytes`` goes as one
message (``KVChunk.bundle``: header, data chunks and trailer together): a small cache's hand-off is
gRPC's per-message time, not its bytes. The other transport is ``nixl_sender.NixlKVSender``.

gRPC flow control: grpc.aio writes one message at a time and ``await``s each write until HTTP/2 flow
control admits it, so a slow decode worker slows the sender; nothing is buffered without bound.
Both ends must set message-size limits above the chunk size (``grpc_message_options``) and the sender
a deadline. The receiving side is the decode worker's ``decode_worker/grpc_receiver.py`` (the tools and
tests serve it over an in-memory pool through ``lab/vlkv_lab/bench/kv_receiver.py``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

import grpc
import torch
from vlkv.common.errors import refusal_of
from vlkv.common.handoff.codec import encode_bundle_wire
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.wire import DEFAULT_CHUNK_BYTES, KVWireError, compact_layers, encode_stream
from vlkv.v1 import kv_pb2, worker_pb2

TRANSFER_KV_METHOD = "/vlkv.v1.DecodeWorker/TransferKV"
# Room for the header (validate_header caps it at 64 KiB by default) and protobuf framing.
MESSAGE_OVERHEAD_BYTES = 1 << 17

Layers = Iterable[tuple[torch.Tensor, torch.Tensor]]


def grpc_message_options(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, int]]:
    """Channel/server options whose message-size limits fit one data chunk plus the header."""
    limit = chunk_bytes + MESSAGE_OVERHEAD_BYTES
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep MiB-sized chunk buffers on the glibc heap instead of a fresh mmap per allocation.

    Every chunk (protobuf bytes, gRPC slices, the receive buffers) is a ~1 MiB allocation; above glibc's
    default mmap threshold each one is mmapped, page-faulted in and unmapped again, which costs more than
    the copy itself (5-10x on VMs). Call once at worker start-up (same as MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ in the environment). Returns False where glibc's mallopt is unavailable.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, mmap_threshold)) and bool(
            libc.mallopt(m_trim_threshold, trim_threshold)
        )
    except (OSError, AttributeError):
        return False


def _serialize(chunk: kv_pb2.KVChunk | bytes) -> bytes:
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


async def _delayed(chunks: Iterator, delay_s: float) -> AsyncIterator:
    """Fault injection for tests (``TransferConfig.fault_chunk_delay_ms``): pause before every chunk after
    the header, so the decode worker has reserved the blocks and the hand-off is visibly in flight."""
    for i, chunk in enumerate(chunks):
        if i:
            await asyncio.sleep(delay_s)
        yield chunk


async def _offload(chunks: Iterator[kv_pb2.KVChunk]) -> AsyncIterator[kv_pb2.KVChunk]:
    """Pull a sync chunk iterator in a worker thread so layer gathering never blocks the event loop."""
    done = object()
    while True:
        chunk = await asyncio.to_thread(next, chunks, done)
        if chunk is done:
            return
        yield chunk


class GrpcKVSender:
    """Client-streaming ``TransferKV`` over an existing ``grpc.aio`` channel.

    The channel should be created with ``options=grpc_message_options(chunk_bytes)``. A refusal or
    transport failure raises ``KVWireError`` carrying the receiver's status code.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        method: str = TRANSFER_KV_METHOD,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = 60.0,
        offload: bool = False,
        chunk_delay_s: float = 0.0,
        bundle_bytes: int | None = None,
    ) -> None:
        """``bundle_bytes``: a ``CompactKV`` of at most this many payload bytes goes as one message
        (default: half of ``chunk_bytes``; 0: never)."""
        self._call = channel.stream_unary(
            method,
            request_serializer=_serialize,
            response_deserializer=worker_pb2.TransferAck.FromString,
        )
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.offload = offload
        self.chunk_delay_s = chunk_delay_s  # fault injection for tests: a pause before each data chunk
        self.bundle_bytes = chunk_bytes // 2 if bundle_bytes is None else bundle_bytes

    transport = "grpc"

    async def send(self, header: kv_pb2.KVChunk, layers: Layers | CompactKV) -> worker_pb2.TransferAck:
        """Encode lazily (layer by layer) and stream; returns the decode worker's ack.

        With ``offload`` each chunk is produced in a worker thread (use it when producing a layer blocks,
        e.g. waiting for a GPU gather); otherwise production runs on the event loop, which is faster for
        tensors already in host memory (no thread hop and GIL hand-off per chunk).
        """
        bundle = (
            isinstance(layers, CompactKV) and layers.nbytes <= self.bundle_bytes and not self.chunk_delay_s
        )
        if isinstance(layers, CompactKV):
            layers = compact_layers(layers)  # (K, V), or (K, V, K scales, V scales) for int8
        chunks = encode_stream(header, layers, self.chunk_bytes, wire=True)
        if bundle:
            whole = list(chunks)
            if sum(map(len, whole)) <= self.chunk_bytes:  # within both ends' message limit
                return await self.send_chunks([encode_bundle_wire(whole)])
            chunks = iter(whole)
        if self.chunk_delay_s:
            return await self.send_chunks(_delayed(chunks, self.chunk_delay_s))
        return await self.send_chunks(_offload(chunks) if self.offload else chunks)

    async def send_chunks(
        self, chunks: AsyncIterable[kv_pb2.KVChunk | bytes] | Iterable[kv_pb2.KVChunk | bytes]
    ) -> worker_pb2.TransferAck:
        """Stream chunks (messages or already serialized bytes; sync or async iterable)."""
        try:
            return await self._call(chunks, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise KVWireError(err.code(), err.details() or "KV transfer failed", refusal_of(err)) from err
