"""The gRPC KV transport: the cache's bytes in client-streaming ``TransferKV`` messages.

``GrpcKVSender.send(header, cache)`` (the ``transport.KVSender`` seam) takes the header chunk (from
``wire.encode_header``) and a ``CompactKV`` or an iterable of per-layer ``(K, V)`` that may still be producing
later layers while earlier ones are on the wire. The other transport is ``nixl_sender.NixlKVSender``.

gRPC flow control: grpc.aio writes one message at a time and ``await``s each write until HTTP/2 flow
control admits it, so a slow decode worker slows the sender; nothing is buffered without bound.
Both ends must set message-size limits above the chunk size (``grpc_message_options``) and the sender
a deadline. On the receiving side ``receive_kv_stream`` feeds a ``KVAssembler`` and turns any failure,
cancellation or deadline into a release of the pool blocks and an aborted call with the right status.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

import grpc
import torch
from vlkv.common.config import DRAIN_BYTES
from vlkv.common.errors import refusal_of
from vlkv.common.handoff.assembler import KVAssembler
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
    ) -> None:
        self._call = channel.stream_unary(
            method,
            request_serializer=_serialize,
            response_deserializer=worker_pb2.TransferAck.FromString,
        )
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.offload = offload
        self.chunk_delay_s = chunk_delay_s  # fault injection for tests: a pause before each data chunk

    transport = "grpc"

    async def send(self, header: kv_pb2.KVChunk, layers: Layers | CompactKV) -> worker_pb2.TransferAck:
        """Encode lazily (layer by layer) and stream; returns the decode worker's ack.

        With ``offload`` each chunk is produced in a worker thread (use it when producing a layer blocks,
        e.g. waiting for a GPU gather); otherwise production runs on the event loop, which is faster for
        tensors already in host memory (no thread hop and GIL hand-off per chunk).
        """
        if isinstance(layers, CompactKV):
            layers = compact_layers(layers)  # (K, V), or (K, V, K scales, V scales) for int8
        chunks = encode_stream(header, layers, self.chunk_bytes, wire=True)
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


async def receive_kv_stream(
    requests: AsyncIterable[kv_pb2.KVChunk | bytes],
    assembler: KVAssembler,
    context: grpc.aio.ServicerContext | None = None,
) -> tuple[kv_pb2.KVHeader, CompactKV]:
    """Feed every request into ``assembler`` and finish it (server side of ``TransferKV``).

    On a ``KVWireError`` the call is aborted with its status when ``context`` is given (``abort``
    raises), else the error propagates. Cancellation, deadlines and unexpected errors abort the
    assembler too, so the pool blocks it allocated are always returned.
    """
    try:
        async for chunk in requests:
            if isinstance(chunk, bytes):
                assembler.feed_wire(chunk)
            else:
                assembler.feed(chunk)
        return assembler.finish()
    except KVWireError as err:
        assembler.abort()
        if context is not None:
            await _drain(requests)  # so the sender sees this status, not INTERNAL (see ``_drain``)
            await context.abort(err.code, err.message)
        raise
    except BaseException:
        assembler.abort()
        raise


async def _drain(requests: AsyncIterable, limit_bytes: int = DRAIN_BYTES, timeout_s: float = 5.0) -> None:
    """Read and drop what a refused sender still streams (at most ``limit_bytes``, ``timeout_s``): a status
    sent while the client is still writing reaches grpcio's client as ``INTERNAL: Internal error from
    Core``. The decode worker's own receiver does the same with its limits (``transfers._drain``)."""

    async def read() -> None:
        seen = 0
        async for chunk in requests:
            seen += len(chunk) if isinstance(chunk, bytes) else chunk.ByteSize()
            if seen > limit_bytes:
                return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except (asyncio.TimeoutError, grpc.RpcError):
        pass


def kv_receiver_handler(
    make_assembler: Callable[[], KVAssembler],
    on_received: Callable[[kv_pb2.KVHeader, CompactKV, object], None] | None = None,
    method: str = TRANSFER_KV_METHOD,
) -> grpc.GenericRpcHandler:
    """A generic ``TransferKV`` handler (for tools, tests and benchmarks; the decode worker has its own
    servicer): one fresh assembler per call, ``on_received(header, cache, pool handle)`` on success."""

    async def transfer(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext):
        assembler = make_assembler()
        header, ckv = await receive_kv_stream(requests, assembler, context)
        if on_received is not None:
            on_received(header, ckv, assembler.handle)
        return worker_pb2.TransferAck(bytes_received=assembler.bytes_received)

    service, name = method.strip("/").split("/")
    handler = grpc.stream_unary_rpc_method_handler(
        transfer,
        request_deserializer=None,  # raw bytes: KVAssembler.feed_wire parses data chunks zero-copy
        response_serializer=worker_pb2.TransferAck.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(service, {name: handler})
