"""Corrupt and hostile KV hand-offs against a live decode worker over real gRPC.

Each bad stream gets its status, the worker keeps serving, and its pool returns to its free count.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from inproc_cluster import InProcCluster
from kv_streams import kv_stream
from vlkv.common.config import ModelConfig, PoolConfig, ServerConfig
from vlkv.common.grpc_server import make_sync_channel
from vlkv.common.handoff.compact_kv import CompactKV
from vlkv.common.handoff.grpc_transport import GrpcKVSender, grpc_message_options
from vlkv.common.handoff.transport import KVReceiver
from vlkv.common.handoff.wire import KVWireError, encode_compact_kv
from vlkv.v1 import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20)
    )
    c = InProcCluster(cfg)
    c.decode_channel = make_sync_channel(c.decode.address, cfg.security)
    c.decode_stub = worker_pb2_grpc.DecodeWorkerStub(c.decode_channel)
    yield c
    c.decode_channel.close()
    c.close()


def _flip(chunks):
    i = next(i for i, c in enumerate(chunks) if c.WhichOneof("part") == "data")
    bad = kv_pb2.KVChunk()
    bad.CopyFrom(chunks[i])
    data = bytearray(bad.data.data)
    data[len(data) // 2] ^= 0x40
    bad.data.data = bytes(data)
    return chunks[:i] + [bad] + chunks[i + 1 :]


def _drop_layer(chunks):
    return [c for c in chunks if not (c.WhichOneof("part") == "data" and c.data.layer == 1)]


def _claim_more(chunks):
    head = kv_pb2.KVChunk()
    head.CopyFrom(chunks[0])
    head.header.layer_lengths[0] += 5
    head.header.prompt_length += 5
    return [head] + chunks[1:]


def _oversized(chunks):
    head = kv_pb2.KVChunk()
    head.CopyFrom(chunks[0])
    head.header.layer_lengths.extend([1] * 100_000)
    head.header.num_layers = len(head.header.layer_lengths)
    return [head] + chunks[1:]


def _no_header(chunks):
    return chunks[1:]


CASES = {
    "truncated (no trailer)": (lambda c: c[:-1], grpc.StatusCode.DATA_LOSS),
    "truncated mid-layer": (lambda c: c[: len(c) // 2], grpc.StatusCode.DATA_LOSS),
    "flipped byte": (_flip, grpc.StatusCode.DATA_LOSS),
    "missing layer": (_drop_layer, grpc.StatusCode.DATA_LOSS),
    "header claims more bytes": (_claim_more, grpc.StatusCode.DATA_LOSS),
    "oversized header": (_oversized, grpc.StatusCode.INVALID_ARGUMENT),
    "no header": (_no_header, grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_stream_is_refused_and_pool_returns(cluster, case):
    mutate, code = CASES[case]
    free = cluster.pool.num_free
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(mutate(kv_stream(cluster, f"bad-{case}"))), timeout=30)
    assert err.value.code() == code, err.value.details()
    assert cluster.pool.num_free == free
    _good_transfer_then_decode(cluster, f"good-after-{case}")
    assert cluster.pool.num_free == free


def test_wrong_fingerprint_refused_before_allocation(cluster):
    free = cluster.pool.num_free
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(
            iter(kv_stream(cluster, "fp", fingerprint="ffffffffffffffff")), timeout=30
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.pool.num_free == free


def test_pool_full_is_resource_exhausted(cluster):
    free = cluster.pool.num_free
    m = cluster.pool.num_blocks * cluster.pool.block_size  # more tokens than the whole pool holds
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "huge", m=m, chunk_bytes=1 << 20)), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert cluster.pool.num_free == free


def test_unclaimed_cache_is_freed_after_its_lease(cluster):
    servicer = cluster.decode.servicer
    free = cluster.pool.num_free
    old = servicer.rendezvous.unclaimed_lease_s
    servicer.rendezvous.unclaimed_lease_s = 0.2
    try:
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "orphan")), timeout=30)
        assert cluster.pool.num_free < free
        import time

        deadline = time.time() + 10
        while cluster.pool.num_free != free and time.time() < deadline:
            time.sleep(0.05)
        assert cluster.pool.num_free == free
    finally:
        servicer.rendezvous.unclaimed_lease_s = old


def _good_transfer_then_decode(cluster, rid: str) -> None:
    ack = cluster.decode_stub.TransferKV(iter(kv_stream(cluster, rid)), timeout=30)
    assert ack.blocks_allocated > 0
    msgs = list(
        cluster.decode_stub.Decode(worker_pb2.DecodeRequest(request_id=rid, wait_ms=5000), timeout=30)
    )
    assert msgs[-1].HasField("finished")
    assert msgs[0].token.token_ids[0] == 5  # the header's first token is streamed first


def test_retried_transfer_supersedes_an_unfinished_one(cluster):
    """A prefill retried after its first worker died mid-transfer sends the same request id again: the new
    transfer is taken, the unfinished one is refused (ABORTED) when it ends, and its blocks are freed."""
    servicer, free = cluster.decode.servicer, cluster.pool.num_free
    chunks = kv_stream(cluster, "retried", m=40)
    go_on, outcome = threading.Event(), {}

    def stalled():  # the first sender: header and one layer chunk, then silence until released
        yield from chunks[:2]
        go_on.wait(30)
        yield from chunks[2:]

    def first():
        try:
            cluster.decode_stub.TransferKV(stalled(), timeout=60)
            outcome["first"] = "ok"
        except grpc.RpcError as exc:
            outcome["first"] = exc.code()

    t = threading.Thread(target=first)
    t.start()
    deadline = time.time() + 10
    while cluster.pool.num_free == free and time.time() < deadline:
        time.sleep(0.01)
    one = free - cluster.pool.num_free
    assert one > 0
    ack = cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "retried", m=40)), timeout=30)
    assert ack.blocks_allocated == one and cluster.pool.num_free == free - 2 * one
    go_on.set()  # the first stream completes after all, but it was superseded
    t.join(30)
    assert outcome["first"] == grpc.StatusCode.ABORTED
    assert cluster.pool.num_free == free - one and servicer.rendezvous.num_unclaimed == 1
    cluster.loop.call_soon_threadsafe(servicer.rendezvous.expire_all)
    deadline = time.time() + 5
    while cluster.pool.num_free != free and time.time() < deadline:
        time.sleep(0.01)
    assert cluster.pool.num_free == free and servicer.rendezvous.num_transfers == 0


def test_refusal_reaches_a_sender_still_streaming_large_messages(cluster):
    """The product's sender (grpc.aio, 4 MiB messages) refused at the header of a large cache: it gets the
    refusal's own status, not grpcio's ``INTERNAL: Internal error from Core`` (the worker drains first)."""
    servicer, free = cluster.decode.servicer, cluster.pool.num_free
    layers, kv_heads, head_dim, dtype = servicer.layout
    m = 20_000  # ~10 MB of K/V: several messages still on their way when the header is refused
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(kv_heads, m, head_dim, generator=g, dtype=dtype) for _ in range(layers)]
    values = [torch.randn(kv_heads, m, head_dim, generator=g, dtype=dtype) for _ in range(layers)]
    ckv = CompactKV(keys, values, prompt_length=m, first_token=1)

    async def send(rid: str):
        channel = grpc.aio.secure_channel(
            cluster.decode.address,
            cluster.cfg.security.channel_credentials(),
            options=grpc_message_options(4 << 20),
        )
        try:
            chunks = encode_compact_kv(
                ckv, request_id=rid, fingerprint=servicer.fingerprint, policy="full", prompt_tokens=m,
                sampling=generate_pb2.SamplingParams(max_new_tokens=4), chunk_bytes=4 << 20, wire=True,
            )  # fmt: skip
            await GrpcKVSender(channel, chunk_bytes=4 << 20).send_chunks(chunks)
        except KVWireError as exc:
            return exc.code
        finally:
            await channel.close()

    for i in range(3):
        assert cluster.run(send(f"large-{i}")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert cluster.pool.num_free == free


def test_both_receivers_are_kv_receivers(cluster):
    servicer = cluster.decode.servicer
    for receiver, transport in ((servicer.grpc_receiver, "grpc"), (servicer.nixl_receiver, "nixl")):
        assert isinstance(receiver, KVReceiver) and receiver.transport == transport
