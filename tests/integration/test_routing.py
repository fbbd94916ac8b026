"""Routing by free KV blocks: a decode worker that cannot admit a request is not chosen."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from inproc_cluster import InProcCluster
from kv_streams import kv_stream
from sample_images import random_png
from vlkv.common.config import ModelConfig, PoolConfig, QueueConfig, ServerConfig, TransferConfig
from vlkv.common.grpc_server import make_sync_channel
from vlkv.deploy.client import build_request, generate
from vlkv.deploy.servers import start_decode_worker
from vlkv.services.load_board import Reservation
from vlkv.v1 import worker_pb2_grpc


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    cfg = ServerConfig(
        model=ModelConfig(path=tiny_model_dirs("llava-gqa")),
        pool=PoolConfig(pool_bytes=1 << 20, cache_wait_ms=600_000),
        queue=QueueConfig(admit_wait_s=2.0),
        # the test parks orphan caches to fill a pool: a long unclaimed lease, no per-sender bound
        transfer=TransferConfig(unclaimed_lease_s=600, max_unclaimed_per_sender=10_000),
    )
    c = InProcCluster(cfg)
    c.second = c.run(start_decode_worker(cfg, model=c.model, tokenizer=c.processor.tokenizer))

    async def register():  # grpc.aio channels belong to the gateway's event loop
        c.gateway.servicer.router.add_decode(c.second.address)

    c.run(register())
    yield c
    c.run(c.second.stop())
    c.close()


def _fill(cluster, address: str, leave_free: int) -> None:
    """Park orphan caches (long lease) on a worker until fewer than ``leave_free`` blocks are free."""
    pool = cluster.decode.servicer.pool if address == cluster.decode.address else cluster.second.servicer.pool
    with make_sync_channel(address, cluster.cfg.security) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        i = 0
        while pool.num_free >= leave_free:
            m = min(40, max(1, (pool.num_free - leave_free + 1) * pool.block_size // 4))
            stub.TransferKV(iter(kv_stream(cluster, f"filler-{address}-{i}", m=m)), timeout=30)
            i += 1


def _wait_for_reports(cluster) -> None:
    """Routing reads the workers' pushed loads: wait until the gateway's view of each decode pool matches
    the pool (a pick made before a filled pool's report arrives sees room that is gone, and is refused)."""
    router = cluster.gateway.servicer.router
    pools = {a.address: a.servicer.pool for a in (cluster.decode, cluster.second)}
    deadline = time.time() + 10
    while any(router.decode[a].load.free_blocks != p.num_free for a, p in pools.items()):
        assert time.time() < deadline, "the decode workers' load reports never showed their pools"
        time.sleep(0.01)


def test_requests_go_to_the_worker_with_room(cluster):
    full, empty = cluster.decode.servicer.pool, cluster.second.servicer.pool
    _fill(cluster, cluster.decode.address, leave_free=5)
    held, free_empty = full.num_free, empty.num_free
    assert held < 5 and free_empty == empty.num_blocks
    for i in range(4):
        req = build_request(images=[random_png(i)], question="what colour is the square ?", max_new_tokens=20)
        out = generate(cluster.stub, req, timeout=60)
        assert out.finished is not None
        assert full.num_free == held  # nothing was admitted on the nearly full worker
    assert empty.num_free == free_empty

    _fill(cluster, cluster.second.address, leave_free=5)
    req = build_request(images=[random_png(9)], question="what colour is the square ?", max_new_tokens=20)
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.stub, req, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no decode worker had room for this request within 2 s" in err.value.details()
    # A request queued at the gateway goes ahead as soon as a worker has room again: the parked caches
    # are freed when their lease ends (ended early here).
    result = {}
    waiter = threading.Thread(target=lambda: result.update(out=generate(cluster.stub, req, timeout=60)))
    waiter.start()
    deadline = time.time() + 5
    while cluster.gateway.servicer.router.num_queued == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert cluster.gateway.servicer.router.num_queued == 1
    for servicer in (cluster.decode.servicer, cluster.second.servicer):
        cluster.loop.call_soon_threadsafe(servicer.rendezvous.expire_all)
    waiter.join(30)
    assert result["out"].finished is not None and cluster.gateway.servicer.router.num_queued == 0
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.1), cluster.loop).result(5)
    assert full.num_free == full.num_blocks and empty.num_free == empty.num_blocks


def test_cache_refused_for_room_is_sent_again_after_waiting(cluster, monkeypatch):
    """The gateway picked a worker on a stale load (another request took the room first): the worker
    refuses the cache at hand-off, and the gateway queues the request for room instead of failing it."""
    router, metrics = cluster.gateway.servicer.router, cluster.gateway.servicer.metrics
    _fill(cluster, cluster.decode.address, leave_free=5)
    _fill(cluster, cluster.second.address, leave_free=5)
    _wait_for_reports(cluster)
    real, calls = router._try_decode, []

    async def stale_first(layer_tokens, max_new_tokens):
        calls.append(1)
        if len(calls) == 1:  # as if its GetLoad had been answered before the pool filled up
            return Reservation(router.decode[cluster.decode.address], 0)
        return await real(layer_tokens, max_new_tokens)

    monkeypatch.setattr(router, "_try_decode", stale_first)
    retries = metrics.registry.get_sample_value("vlkv_hand_off_retries_total")
    req = build_request(images=[random_png(3)], question="what colour is the square ?", max_new_tokens=20)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(out=generate(cluster.stub, req, timeout=60)))
    waiter.start()
    deadline = time.time() + 10
    while router.num_queued == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert router.num_queued == 1 and "out" not in result  # refused at hand-off, now waiting for room
    assert metrics.registry.get_sample_value("vlkv_hand_off_retries_total") == retries + 1
    for servicer in (cluster.decode.servicer, cluster.second.servicer):
        cluster.loop.call_soon_threadsafe(servicer.rendezvous.expire_all)
    waiter.join(30)
    assert result["out"].finished is not None and result["out"].token_ids
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.1), cluster.loop).result(5)
    for servicer in (cluster.decode.servicer, cluster.second.servicer):
        assert servicer.pool.num_free == servicer.pool.num_blocks
