"""Compact-KV wire format over real gRPC on localhost: the decode service takes TransferKV as bytes from any
sender, round trips into the decode worker's receiver over an in-memory pool (``vlkv_lab.bench.kv_receiver``),
errors and stalls that reach the client and free the blocks, flow control against a slow receiver, and the
one-bundle hand-off of a small cache. (The format itself: tests/unit/test_kv_wire.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from kv_wire_helpers import DTYPES, FakePool, bits_equal, encode, make_ckv
from vlkv.common.handoff.grpc_transport import GrpcKVSender, grpc_message_options
from vlkv.common.handoff.wire import KVWireError, encode_stream
from vlkv.v1 import kv_pb2, worker_pb2

DL, FPC = grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION


def test_decode_service_takes_transferkv_as_bytes_from_any_sender():
    """``add_decode_servicer``: TransferKV sees raw bytes, whether the client is the generated stub
    (KVChunk messages) or ``GrpcKVSender`` (pre-encoded); the other methods keep their messages."""
    from vlkv.decode_worker.server import add_decode_servicer
    from vlkv.v1 import worker_pb2_grpc

    ckv = make_ckv(torch.float16, [3, 40], m=40)
    seen: list[type] = []

    class Recorder(worker_pb2_grpc.DecodeWorkerServicer):
        async def TransferKV(self, requests, context):
            pool = FakePool()
            asm = pool.assembler(ckv)
            async for raw in requests:
                seen.append(type(raw))
                asm.feed_wire(raw)
            asm.finish()
            return worker_pb2.TransferAck(bytes_received=asm.bytes_received, blocks_allocated=2)

        async def GetLoad(self, request, context):
            assert isinstance(request, worker_pb2.LoadRequest)
            return worker_pb2.WorkerLoad(address="here")

    async def main():
        server = grpc.aio.server(options=grpc_message_options(1 << 16))
        add_decode_servicer(Recorder(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                acks = [await stub.TransferKV(iter(encode(ckv, 100)))]
                header = encode(ckv)[0]
                sender = GrpcKVSender(ch, chunk_bytes=100)
                acks.append(await sender.send(header, zip(ckv.keys, ckv.values, strict=True)))
                load = await stub.GetLoad(worker_pb2.LoadRequest())
        finally:
            await server.stop(0.5)
        return acks, load

    acks, load = asyncio.run(main())
    assert [a.bytes_received for a in acks] == [ckv.nbytes] * 2 and load.address == "here"
    assert set(seen) == {bytes} and len(seen) == 2 * len(encode(ckv, 100))


async def _grpc_transfer(ckv, chunks_or_layers, received: list, timeout_s=10.0):
    """Send through ``GrpcKVSender`` to the decode worker's own ``TransferKV`` receiver over an in-memory
    pool (``kv_receiver``); ``received`` gets each arrived cache read back from the pool. Returns the ack
    (or raises the sender's KVWireError) and the receiver."""
    from vlkv.decode_worker.server import add_decode_servicer
    from vlkv_lab.bench.kv_receiver import ReceiverServicer

    layout = (ckv.num_layers, ckv.num_kv_heads, ckv.head_dim, ckv.dtype)
    servicer = ReceiverServicer(layout, 8 << 20, False, None)
    cache = servicer.cache
    servicer.admission.arrivals.on_arrival = lambda seq: received.append(
        [cache.read(t, k) for t, k in zip(seq.blocks.tables, seq.lengths, strict=True)]
    )
    server = grpc.aio.server(options=grpc_message_options(1 << 16))
    add_decode_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=grpc_message_options(1 << 16)
        ) as ch:
            sender = GrpcKVSender(ch, chunk_bytes=1 << 16, timeout_s=timeout_s)
            try:
                if isinstance(chunks_or_layers, tuple):
                    return await sender.send(*chunks_or_layers), servicer
                return await sender.send_chunks(chunks_or_layers), servicer
            except KVWireError as exc:
                exc.servicer = servicer
                raise
    finally:
        await server.stop(0.5)


def _receiver_fp():
    from vlkv_lab.bench.kv_receiver import FINGERPRINT

    return FINGERPRINT


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpc_round_trip(dtype):
    ckv = make_ckv(dtype, [1, 70, 300, 1000], m=1000)  # the last layer spans several 64 KiB chunks
    received = []
    header = encode(ckv, fingerprint=_receiver_fp())[0]
    layers = zip(ckv.keys, ckv.values, strict=True)
    ack, servicer = asyncio.run(_grpc_transfer(ckv, (header, layers), received))
    assert ack.bytes_received == ckv.nbytes
    (out,) = received
    assert all(
        bits_equal(a, b)
        for (a, b), k, v in zip(out, ckv.keys, ckv.values, strict=True)
        for a, b in ((a, k), (b, v))
    )
    assert servicer.pool.num_free == servicer.pool.num_blocks


def test_grpc_chunks_cut_inside_a_row_land_where_they_belong():
    """A foreign sender whose chunks end mid-row (here every 100 bytes: rows are 16 or 32 bytes)."""
    ckv = make_ckv(torch.float32, [3, 17], m=20)
    received = []
    ack, _ = asyncio.run(_grpc_transfer(ckv, encode(ckv, 100, fingerprint=_receiver_fp()), received))
    (out,) = received
    assert all(
        bits_equal(a, b)
        for (a, b), k, v in zip(out, ckv.keys, ckv.values, strict=True)
        for a, b in ((a, k), (b, v))
    )


def test_grpc_errors_reach_the_client_and_free_blocks():
    ckv = make_ckv(torch.float16, [2, 3])
    chunks = encode(ckv, 16, fingerprint=_receiver_fp())
    chunks[2].data.crc32c ^= 1
    with pytest.raises(KVWireError) as exc:
        asyncio.run(_grpc_transfer(ckv, chunks, []))
    assert exc.value.code == DL
    pool = exc.value.servicer.pool
    assert pool.num_free == pool.num_blocks and exc.value.servicer.admission.active == 0
    with pytest.raises(KVWireError) as exc:
        asyncio.run(_grpc_transfer(ckv, encode(ckv, fingerprint="other"), []))
    assert exc.value.code == FPC
    nan = make_ckv(torch.float16, [2, 3])
    nan.values[1][0, 1, 2] = float("nan")
    with pytest.raises(KVWireError) as exc:
        asyncio.run(_grpc_transfer(nan, encode(nan, fingerprint=_receiver_fp()), []))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "layer 1 values" in exc.value.message
    pool = exc.value.servicer.pool
    assert pool.num_free == pool.num_blocks


def test_grpc_stalled_sender_hits_deadline_and_frees_blocks():
    ckv = make_ckv(torch.float16, [2, 3])
    chunks = encode(ckv, fingerprint=_receiver_fp())

    async def stall():
        yield chunks[0]
        await asyncio.sleep(30)

    async def main():
        with pytest.raises(KVWireError) as exc:
            await _grpc_transfer(ckv, stall(), [], timeout_s=0.5)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        return exc.value.servicer

    servicer = asyncio.run(main())
    assert servicer.pool.num_free == servicer.pool.num_blocks and servicer.admission.active == 0


def test_grpc_slow_receiver_slows_the_sender():
    """HTTP/2 flow control: the lazily encoding sender stays a bounded number of chunks ahead."""
    chunk = 1 << 16
    ckv = make_ckv(torch.float32, [160_000])  # 20 MB: ~312 chunks of 64 KiB
    consumed, produced, lead = [0], [0], [0]

    async def slow_transfer(requests, context):
        async for _ in requests:
            consumed[0] += 1
            await asyncio.sleep(0.002)
        return worker_pb2.TransferAck()

    def counted(chunks):
        for c in chunks:
            produced[0] += 1
            lead[0] = max(lead[0], produced[0] - consumed[0])
            yield c

    async def main():
        handler = grpc.stream_unary_rpc_method_handler(
            slow_transfer, response_serializer=worker_pb2.TransferAck.SerializeToString
        )
        server = grpc.aio.server(options=grpc_message_options(chunk))
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("vlkv.v1.DecodeWorker", {"TransferKV": handler})]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        layers = zip(ckv.keys, ckv.values, strict=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_message_options(chunk)) as ch:
            stream = encode_stream(encode(ckv)[0], layers, chunk, wire=True)
            await GrpcKVSender(ch, chunk_bytes=chunk).send_chunks(counted(stream))
        await server.stop(0)

    asyncio.run(main())
    assert produced[0] == consumed[0] > 300
    # unbounded, the lazy sender would run the whole stream (~312 chunks) ahead; HTTP/2's window (grown by
    # gRPC's BDP probes, more so on a loaded machine: 163 seen) keeps it to a part of it
    assert lead[0] < produced[0] * 2 // 3, (
        f"sender ran {lead[0]} of {produced[0]} chunks ahead of a slow receiver"
    )


def test_a_small_cache_travels_as_one_bundle_and_is_checked_the_same():
    from vlkv.common.handoff.codec import encode_bundle_wire, split_bundle_wire

    ckv = make_ckv(torch.float16, [3, 5], m=9)
    wire = [c.SerializeToString() for c in encode(ckv, 40, fingerprint=_receiver_fp())]
    bundle = encode_bundle_wire(wire)
    assert [bytes(e) for e in split_bundle_wire(bundle)] == wire  # each entry is its chunk's own bytes
    parsed = kv_pb2.KVChunk.FromString(bundle).bundle
    assert parsed.header.request_id == "req-1" and len(parsed.data) == len(wire) - 2
    received = []
    header = encode(ckv, fingerprint=_receiver_fp())[0]
    ack, servicer = asyncio.run(_grpc_transfer(ckv, (header, ckv), received))  # a CompactKV: bundled
    assert ack.bytes_received == ckv.nbytes
    assert all(
        bits_equal(a, k) and bits_equal(b, v)
        for (a, b), k, v in zip(received[0], ckv.keys, ckv.values, strict=True)
    )
    bad = bytearray(bundle)
    bad[-40] ^= 1  # inside the last data chunk's payload
    with pytest.raises(KVWireError) as exc:
        asyncio.run(_grpc_transfer(ckv, [bytes(bad)], []))
    assert exc.value.code == DL
    pool = exc.value.servicer.pool
    assert pool.num_free == pool.num_blocks
    with pytest.raises(KVWireError) as exc:  # a bundle is the whole stream: nothing may follow it
        asyncio.run(_grpc_transfer(ckv, [bundle, wire[-1]], []))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
