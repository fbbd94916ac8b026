"""What one sender can hold of a decode worker, and whom a prefill worker dials (issue 15, items 3, 7, 9), on
live servers over real gRPC: idle limits, unclaimed caches, cancels during the hand-off, concurrent
transfers, registered decode addresses and a bounded channel cache."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from inproc_cluster import InProcCluster
from kv_streams import kv_stream
from vlkv.common.config import (
    Limits,
    ModelConfig,
    PoolConfig,
    PrefillConfig,
    SecurityConfig,
    ServerConfig,
    TransferConfig,
)
from vlkv.common.grpc_server import make_sync_channel
from vlkv.prefill_worker.peers import DecodePeers
from vlkv.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    t = TransferConfig(idle_s=0.5, max_transfers=2, max_unclaimed_per_sender=2, unclaimed_lease_s=30)
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")), pool=PoolConfig(pool_bytes=4 << 20), transfer=t
    )
    c = InProcCluster(cfg, client=False)
    c.channel_ = make_sync_channel(c.decode.address, cfg.security)
    c.decode_stub = worker_pb2_grpc.DecodeWorkerStub(c.channel_)
    yield c
    c.channel_.close()
    c.close()


def _wait(cond, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _stalled(chunks, release: threading.Event):
    yield chunks[0]  # the header takes the blocks, then nothing
    release.wait(30)
    yield from chunks[1:]


def test_header_then_silence_ends_at_the_idle_limit(cluster):
    free = cluster.pool.num_free
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(_stalled(kv_stream(cluster, "silent"), release), timeout=30)
    release.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10  # idle_s = 0.5, not the client's 30 s
    assert _wait(lambda: cluster.pool.num_free == free)


def test_unclaimed_caches_are_bounded_per_sender(cluster):
    free = cluster.pool.num_free
    servicer = cluster.decode.servicer
    for i in range(2):
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, f"parked-{i}")), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "parked-2")), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.rendezvous.num_unclaimed == 2
    cluster.loop.call_soon_threadsafe(servicer.rendezvous.expire_all)
    assert _wait(lambda: cluster.pool.num_free == free)


def test_cancel_during_the_hand_off_frees_at_once(cluster):
    free = cluster.pool.num_free
    release = threading.Event()
    chunks = kv_stream(cluster, "cancelled", m=40, chunk_bytes=1024)
    decode = cluster.decode_stub.Decode(worker_pb2.DecodeRequest(request_id="cancelled", wait_ms=30_000))
    outcome = {}

    def send():
        def slow():
            yield chunks[0]
            release.wait(30)
            yield from chunks[1:]

        try:
            cluster.decode_stub.TransferKV(slow(), timeout=30)
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    t = threading.Thread(target=send)
    t.start()
    assert _wait(lambda: cluster.pool.num_free < free)  # the header took its blocks
    decode.cancel()  # the client goes away while its cache is on the wire
    assert _wait(lambda: cluster.pool.num_free == free, timeout=5)  # freed now, not at the lease
    release.set()
    t.join(30)
    assert outcome["code"] == grpc.StatusCode.CANCELLED
    # and the other order: the Decode call gave up before the cache came
    with pytest.raises(grpc.RpcError):
        list(cluster.decode_stub.Decode(worker_pb2.DecodeRequest(request_id="late", wait_ms=50)))
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "late")), timeout=30)
    assert err.value.code() == grpc.StatusCode.CANCELLED and cluster.pool.num_free == free


def test_concurrent_transfers_are_bounded(cluster):
    free = cluster.pool.num_free
    release = threading.Event()
    threads = []
    for i in range(2):
        chunks = kv_stream(cluster, f"slot-{i}")

        def hold(chunks=chunks):
            try:
                cluster.decode_stub.TransferKV(_stalled(chunks, release), timeout=30)
            except grpc.RpcError:
                pass  # the idle limit ends them

        threads.append(threading.Thread(target=hold))
        threads[-1].start()
    assert _wait(lambda: cluster.decode.servicer.receiver.active == 2)
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub.TransferKV(iter(kv_stream(cluster, "third")), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    release.set()
    for t in threads:
        t.join(30)
    cluster.loop.call_soon_threadsafe(cluster.decode.servicer.rendezvous.expire_all)  # whichever arrived
    assert _wait(lambda: cluster.pool.num_free == free)


def test_prefill_dials_only_registered_decode_workers(cluster):
    stub = worker_pb2_grpc.PrefillWorkerStub(make_sync_channel(cluster.prefill.address, cluster.cfg.security))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(worker_pb2.PrefillRequest(request_id="x", decode_address="192.0.2.1:50051"), timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert time.monotonic() - start < 5
    peers = cluster.prefill.servicer.peers
    assert not peers.permitted("192.0.2.1:50051") and peers.permitted(cluster.decode.address)
    peers.allow("192.0.2.1:50051")
    assert peers.permitted("192.0.2.1:50051")
    peers.registered.discard("192.0.2.1:50051")


def test_channel_cache_is_bounded():
    cfg = PrefillConfig(
        Limits(), TransferConfig(max_peers=2, decode_peers=("10.0.0.1:1",)), SecurityConfig(), 0.0
    )

    async def go():
        peers = DecodePeers(cfg)
        for port in range(1, 6):
            peers.channel(f"127.0.0.1:{port}")
        peers.channel("10.0.0.1:1")
        kept = list(peers._channels)
        with pytest.raises(Exception) as err:
            peers.channel("10.0.0.2:1")
        await peers.close()
        return kept, err.value

    kept, err = asyncio.run(go())
    assert kept == ["127.0.0.1:5", "10.0.0.1:1"]
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
